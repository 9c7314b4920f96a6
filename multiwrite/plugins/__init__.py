"""The plugin host: the backend contract (`backend`, `plan`), the hook specifications (`hookspecs`) and backend
discovery and selection (`dispatch`)."""
