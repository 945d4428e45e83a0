pytest_plugins = ["zero3.testing.fixtures"]
