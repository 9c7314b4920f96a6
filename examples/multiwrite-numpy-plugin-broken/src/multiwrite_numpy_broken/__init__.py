"""A deliberately broken copy of the example plugin: the kit must fail it."""
