"""The version of pallas_hub, in one place: the package, its distribution (pyproject's dynamic version)
and the provenance written into every build's metadata.json read it from here."""

__version__ = "0.1.0"
