"""blink's version, written once: the distribution's metadata (pyproject.toml's dynamic version) and the server's
``/version`` both read it, so a source tree run without installing (``PYTHONPATH=src``) answers the same."""

__version__ = "0.1.0"
