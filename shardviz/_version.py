"""The package's version, in a module of its own so that any layer (a real rank saying hello, the
wheel's build) reads it without importing the package's front end."""

__version__ = "0.1.0"
