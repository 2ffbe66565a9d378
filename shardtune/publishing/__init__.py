"""The trained model as others load it: a Hugging Face directory written atomically (saving), and its upload to the
Hugging Face Hub (hub)."""
