"""The pure mutation core: plain data in, JSON Patch operations out. No I/O, no web framework."""
