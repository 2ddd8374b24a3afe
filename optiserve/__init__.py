"""optiserve: train, optimize, serve and measure vision and text models."""

__version__ = "0.1.0"
