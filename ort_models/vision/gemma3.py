"""Gemma 3's vision tower (projector type "gemma3"): SigLIP and its pooling projector.

Preprocessing (mtmd's fixed-size preprocessor): the image fitted into image_size²
(bilinear, aspect kept, centred on black), normalised with the file's mean and std.
The tower (clip.cpp `clip_graph_siglip`): a patch convolution with a bias plus learned
position embeddings, LayerNorm blocks with biases and a tanh-GELU FFN, a final LayerNorm.
The projector: a 2-D average pool of n_merge × n_merge patches (4 for every Gemma 3, the
test models' clip.vision.projector.scale_factor otherwise), an RMSNorm by
mm.soft_emb_norm and the product with mm.input_projection [n_embd, text width].
"""

from __future__ import annotations

from typing import ClassVar

from onnx import TensorProto

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .family import EMBEDDINGS, PIXELS, PreparedImage, VisionFamily, vit_layer_shapes
from .image_input import DecodedImage, normalize, resize
from .mmproj import VisionHParams, read_vision_hparams
from .vit_graph import VisionGraph


class Gemma3Vision(VisionFamily):
    projector: ClassVar[str] = "gemma3"
    image_begin: ClassVar[str] = "<start_of_image>"
    image_end: ClassVar[str] = "<end_of_image>"

    def read_hparams(self, f: GGUFFile) -> VisionHParams:
        hp = read_vision_hparams(f, n_merge=4)
        side = hp.image_size // hp.patch_size
        if hp.image_size % hp.patch_size or side % hp.n_merge:
            raise GGUFError(f"{f.path}: clip.vision.image_size {hp.image_size} is not a whole "
                            f"number of {hp.patch_size}-pixel patches pooled {hp.n_merge} by "
                            f"{hp.n_merge}")
        return hp

    def tensor_shapes(self, hp: VisionHParams) -> dict[str, tuple[int, ...]]:
        e, p = hp.n_embd, hp.patch_size
        n_patches = (hp.image_size // p) ** 2
        return {"v.patch_embd.weight": (e, 3, p, p), "v.patch_embd.bias": (e,),
                "v.position_embd.weight": (n_patches, e),
                **vit_layer_shapes(hp, biases=True, norm_bias=True, gate=False),
                "v.post_ln.weight": (e,), "v.post_ln.bias": (e,),
                "mm.soft_emb_norm.weight": (e,),
                "mm.input_projection.weight": (e, hp.projection_dim)}

    def prepare(self, image: DecodedImage, hp: VisionHParams) -> PreparedImage:
        size = hp.image_size
        rgb = resize(image.rgb, size, size, "bilinear", pad=True)
        side = size // hp.patch_size // hp.n_merge
        return PreparedImage(normalize(rgb, hp.image_mean, hp.image_std), (side, side),
                             side * side, image.digest)

    def build(self, vg: VisionGraph) -> None:
        g, hp = vg.g, vg.hp
        size, m = hp.image_size, hp.n_merge
        side = size // hp.patch_size  # patches per side
        pixels = g.input(PIXELS, TensorProto.FLOAT, [3, size, size])
        x = vg.channels_last(vg.patch_conv(pixels, "v.patch_embd.weight"))  # [P, E]
        x = g.op("Add", [g.op("Add", [x, vg.param("v.patch_embd.bias")]),
                         vg.param("v.position_embd.weight")])
        for il in range(hp.n_layer):
            x = vg.layer(x, il, norm="layer", ffn=hp.ffn)
        x = vg.norm(x, "v.post_ln", "layer")
        grid = g.op("Reshape", [g.op("Transpose", [x], perm=[1, 0]),
                                g.const([1, hp.n_embd, side, side])])  # [1, E, side, side]
        pooled = g.op("AveragePool", [grid], kernel_shape=[m, m], strides=[m, m])
        x = vg.channels_last(pooled)  # [tokens, E], row-major over the pooled grid
        x = g.op("SimplifiedLayerNormalization", [x, vg.param("mm.soft_emb_norm.weight")],
                 axis=-1, epsilon=hp.eps, stash_type=1)
        g.op("MatMul", [x, vg.param("mm.input_projection.weight")], out=[EMBEDDINGS])
        g.output(EMBEDDINGS, TensorProto.FLOAT, [(side // m) ** 2, hp.projection_dim])
