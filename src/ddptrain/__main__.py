from .start import entry

entry()
