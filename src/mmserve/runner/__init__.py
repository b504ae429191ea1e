"""torch lives here: the model runner, attention, fusion, sampling."""
