"""The server: warm variants behind a DynamicBatcher, /predict, Open Inference Protocol v2, /stats."""

VARIANT_HEADER = "X-Optiserve-Variant"  # on every inference answer, errors included: the variant that took it
