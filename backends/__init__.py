"""The built-in backends, installed as `multiwrite.backends` and registered through the `multiwrite`
entry-point group exactly like third-party plugins."""
