"""saltext.vmhost: Salt modules, states and engine for vmhostd (see docs/salt.md)."""
