"""labkit: an interactive, measured optimization lab for large language models (see README.md).

Importing the package is cheap; torch is imported by the modules that need it."""

__version__ = "0.1.0"
