"""Using trained weights without training: decoding and fill-mask."""
