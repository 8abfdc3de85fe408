"""Wire formats: length-prefixed JSON frames and the messages carried in them."""
