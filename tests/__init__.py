"""deepinfer's test suite (a package, so test modules can share helpers through relative imports)."""
