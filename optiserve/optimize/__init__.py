"""The offline optimizer: passes (fuse, trace, export, quantize) -> validated variants -> artifact folder."""
