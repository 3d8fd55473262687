"""The `chunkpilot` command. Subcommands import their part lazily so `chunkpilot --help` needs no torch."""
