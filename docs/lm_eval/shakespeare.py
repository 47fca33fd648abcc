"""The documents of the `shakespeare_held_out` task: the bundled corpus's held-out works, as `plainformer
train` holds them out (`plainformer.load_split`), one document per work."""

import datasets

import plainformer as pf


def held_out_works(**_: object) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_dict({"text": list(pf.load_split().documents("val"))})}
