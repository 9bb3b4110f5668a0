"""Built-in policies, each module a plugin registered like any third-party one."""
