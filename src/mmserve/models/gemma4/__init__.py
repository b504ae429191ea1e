"""Gemma 4 (Gemma4ForConditionalGeneration): the family plug-in, built up in parts."""
