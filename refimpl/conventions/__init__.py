"""Device I/O conventions: a prompt turned into the fixed-shape graph calls a device makes, with every input
and output named as that toolchain names it (device_conventions.md)."""
