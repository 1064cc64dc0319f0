"""The bottom layer, imported by every other: configuration errors, errors agreed over every rank, atomic file
writes, the number vocabulary, strict typed YAML, settings merged from their components' dataclasses (options),
short hashes, the supported library versions."""
