"""Code both mlxr processes use: settings, errors and the runner wire protocol."""
