"""The runnable scripts, each `python scripts/<name>.py`; importable as `leanrl.scripts.<name>` for their presets
(`DEFAULTS`)."""
