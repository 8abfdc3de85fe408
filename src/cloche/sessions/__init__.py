"""Sessions: live kernels by id, the warm pool that starts them, and the manager over both."""
