"""`python -m optiserve ...` (and `torchrun -m optiserve ...`) run the CLI."""

from optiserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
