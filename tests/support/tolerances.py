"""The generated zoo's tolerance of a weight, from its float floor (docs/models.md, "Tolerances").

keras_hub models trained with Adam are held to the suite's 1e-4, or to a few times the weight's
own float floor where that is higher: Keras alone, every initial weight moved by one float32
unit, ends `floor` away from its own run, and a reordered float sum is such a nudge at every
step. Attention key biases (a true gradient of zero, so Adam's steps there are rounding noise
in Keras too) have floors of 1e-3 to 4e-2 in the zoo's tiny configs; the other weights of the
same models stay at 1e-4. Capped, so that no weight is excused an error of the size the zoo
exists to catch (0.45 to 2.4 before issue 62's fixes).
"""

TOLERANCE = 1e-4
FLOOR_FACTOR, FLOOR_CAP = 4, 0.1


def tolerance(floor: float) -> float:
    """The tolerance of a weight whose float floor is `floor`."""
    return max(TOLERANCE, min(FLOOR_FACTOR * floor, FLOOR_CAP))
