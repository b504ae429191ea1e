"""What the model will see: media loading, items, placeholders, hashing. No engine state here."""
