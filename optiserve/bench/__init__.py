"""Measure and compare: engine timings, an HTTP load generator, statistics with confidence
intervals, and A/B reports (Markdown, HTML, JSON, plots)."""
