"""Multimodal inputs: image processors (numpy / PIL, equal to the checkpoints' HF processors)
that turn images into the vision encoders' pixel rows and placeholder counts."""
