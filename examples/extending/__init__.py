"""The extension guide's examples (docs/extending.md): an algorithm, a callback, a model."""
