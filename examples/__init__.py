"""The opkit example: a tiny Vision Transformer on scikit-learn's bundled 8x8 digits."""
