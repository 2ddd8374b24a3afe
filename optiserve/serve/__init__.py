"""The server: warm variants behind a DynamicBatcher, /predict, Open Inference Protocol v2, /stats."""
