"""Configuration: typed, validated, immutable, loaded from TOML; secrets from the environment or files."""
