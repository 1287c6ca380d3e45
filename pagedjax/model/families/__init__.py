"""Model families: each module holds one Hugging Face family's config mapping, model specifics and weight names."""
