"""The model zoo: real third-party models trained through the package and compared with eager (correctness)."""
