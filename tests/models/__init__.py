"""Tests of what computes, and the kernels."""
