"""Variables built without memory (`hf.scope`), and materialising the ones a rank needs."""
