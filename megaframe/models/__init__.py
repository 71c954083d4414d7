"""Model families: one folder each (spec.py, hf.py), registered by name in models/registry.py."""
