"""The built-in workflows (a plugin: registered through ``register_workflows``)."""
