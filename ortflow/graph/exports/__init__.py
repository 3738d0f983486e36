"""What exporters (``torch.onnx.export``, both exporters) write that training needs read back or rewritten."""
