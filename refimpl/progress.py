"""Progress bars for long work (a forward pass layer by layer, a digest of the weights): drawn on stderr when it
is a terminal and the work has run for DELAY seconds, never otherwise (pipes, files, tests stay quiet).

    with layer_progress("forward", total=36) as advance:
        for layer in ...:
            ...
            advance()

A command that already draws a rich Progress (e.g. `refimpl golden`) passes it to `attach`, and the bars become
tasks of it: rich draws one live display at a time.
"""

import contextlib
import sys
import time

DELAY = 1.0
_parent = []   # the rich Progress of the running command, if it draws one


@contextlib.contextmanager
def attach(progress):
    """Draw layer bars as tasks of `progress` (a started rich.progress.Progress) while inside this block."""
    _parent.append(progress)
    try:
        yield progress
    finally:
        _parent.remove(progress)


def _enabled() -> bool:
    return bool(_parent) or sys.stderr.isatty()


@contextlib.contextmanager
def layer_progress(description: str, total: int, unit: str = "layers"):
    """Yields advance(n=1); a bar appears once the work has run for DELAY seconds, if a terminal shows it."""
    start, done, bar = time.monotonic(), [0], []

    def advance(n: int = 1):
        done[0] += n
        if not bar and time.monotonic() - start >= DELAY and _enabled():
            bar.append(_open(f"{description} ({total} {unit})", total))
        if bar:
            progress, task = bar[0]
            progress.update(task, completed=round(done[0]))

    try:
        yield advance
    finally:
        if bar:
            progress, task = bar[0]
            if _parent and progress is _parent[-1]:
                progress.remove_task(task)
            else:
                progress.stop()


def _open(description: str, total: int):
    # lazy: rich only once a bar is drawn, so `import refimpl` (which the models' progress reaches) does not load it
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    if _parent:
        progress = _parent[-1]
    else:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        progress.start()
    return progress, progress.add_task(description, total=total)
