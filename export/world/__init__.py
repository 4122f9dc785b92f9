"""The shapes world and the models edit-rt embeds: the world's scenes, looks and reader
(`shapes.py`, `looks.py`), the trainers (`train.py` the model, `slider_training.py` the concept
sliders, `look_round_trip.py` their autoencoder check) and the random models (`tiny_model.py`,
`sd_random.py`). Imports `compile/` and `runtime/`'s lower layers.
"""
