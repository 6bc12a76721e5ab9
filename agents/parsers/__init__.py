"""Pure parsers: the text a native tool prints in, a typed result out (no I/O, no devices)."""
