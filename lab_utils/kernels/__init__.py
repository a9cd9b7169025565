"""Device kernels the course writes by hand (lab 16): paged decode attention in Triton."""
