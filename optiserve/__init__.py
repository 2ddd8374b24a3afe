"""optiserve: train, optimize, serve and measure vision models."""

__version__ = "0.1.0"
