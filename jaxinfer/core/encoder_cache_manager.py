"""The scheduler's side of the encoder cache (vLLM V1's EncoderCacheManager, simplified).

A vision encoder's output for an image (its `length` embedding rows) is computed at the step
that first needs the image's tokens and kept by the runner under the image's identifier. This
manager decides, step by step, which images the runner encodes (within an encoder budget of
embedding rows per step) and which outputs it may drop: an output stays until its room is
needed, so that another request with the same image (or the same request after a
preemption) finds it. An image's tokens are always scheduled in one step (chunked prefill
never splits them), so an output is needed by the step that schedules them only: the
outputs this step uses are pinned while it is scheduled, the others are evictable, least
recently used first."""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, cache_size: int):
        """cache_size: embedding rows the runner keeps at most (>= the largest image)."""
        self.cache_size = cache_size
        self.entries: OrderedDict[str, int] = OrderedDict()  # identifier -> rows, LRU first
        self.used = 0
        self.pinned: set[str] = set()  # used by the step being scheduled
        self.freed: list[str] = []  # dropped since the last step's output (the runner too)
        self.num_encoder_runs = 0  # images the runner was asked to encode
        self.num_hits = 0  # images a step needed that were cached already

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.entries

    def can_allocate(self, rows: int, pending: int) -> bool:
        """Room for `rows` more, with `pending` rows already promised in this step, after
        evicting every unpinned entry if need be."""
        evictable = sum(n for k, n in self.entries.items() if k not in self.pinned)
        return self.used - evictable + pending + rows <= self.cache_size

    def use(self, identifier: str) -> None:
        """A cached output this step reads (pinned until the step is scheduled)."""
        self.entries.move_to_end(identifier)
        self.pinned.add(identifier)
        self.num_hits += 1

    def allocate(self, identifier: str, rows: int) -> None:
        """Room for an output the runner computes in this step (evicting LRU entries)."""
        for key in list(self.entries):
            if self.used + rows <= self.cache_size:
                break
            if key not in self.pinned:
                self.used -= self.entries.pop(key)
                self.freed.append(key)
        self.entries[identifier] = rows
        self.used += rows
        self.pinned.add(identifier)
        self.num_encoder_runs += 1

    def end_step(self) -> tuple[str, ...]:
        """Unpin this step's outputs; the identifiers dropped since the last step."""
        self.pinned.clear()
        freed, self.freed = tuple(self.freed), []
        return freed

    def reset(self) -> None:
        """Forget everything (the runner drops its outputs too)."""
        self.freed.extend(self.entries)
        self.entries.clear()
        self.used = 0



class StepImages:
    """One schedule() call's images: encoder rows left in the step's budget, rows promised
    to the cache, identifiers to encode, and per request the indices of the images its
    chunk needs."""

    def __init__(self, budget: int):
        self.budget = budget
        self.pending = 0
        self.identifiers: set[str] = set()
        self.needs: dict[str, list[int]] = {}


def check_images(request, cache: EncoderCacheManager | None, budget: int) -> None:
    """A request with images: ValueError unless the engine takes them and each image fits
    one step."""
    if cache is None:
        raise ValueError("mm_features: this engine takes text only")
    big = max(f.length for f in request.mm_features)
    if big > budget:
        raise ValueError(f"an image of {big} tokens does not fit one step "
                         f"(max_num_batched_tokens={budget}; an image's tokens are never "
                         "split across steps)")


def fit_images(cache: EncoderCacheManager, request, computed: int, n: int, budget: int,
               enc: StepImages) -> int:
    """The chunk of `n` tokens from `computed` cut so that it never ends inside an image
    (grown to the image's end when it starts inside one and the budget allows, else 0),
    nor reaches an image whose encoder output is neither cached nor affordable in this
    step (the encoder budget, the cache's room); the images it reaches that need
    encoding are noted in `enc`."""
    need: list[int] = []
    for k, f in enumerate(request.mm_features):
        end = computed + n
        if f.end <= computed:
            continue
        if f.offset >= end:
            break
        if f.end > end:  # the chunk would end inside this image
            if f.offset > computed:
                n = f.offset - computed
                break
            if f.end - computed > budget:
                return 0
            n = f.end - computed
        if f.identifier in cache:  # (encoded before, or by this step for another)
            cache.use(f.identifier)
            need.append(k)
            continue
        if f.identifier in enc.identifiers:
            cache.num_hits += 1
            need.append(k)
            continue
        if f.length > enc.budget or not cache.can_allocate(f.length, enc.pending):
            n = f.offset - computed if f.offset > computed else 0
            break
        enc.identifiers.add(f.identifier)
        enc.pending += f.length
        enc.budget -= f.length
        need.append(k)
    if n > 0 and need:
        enc.needs[request.request_id] = need
    return n


def commit_images(cache: EncoderCacheManager | None, enc: StepImages, requests: dict,
                  num_scheduled: dict) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """The step's encoder inputs (request id -> indices of its images to encode, each
    image once), their room taken in the cache; the identifiers the runner drops."""
    if cache is None:
        return {}, ()
    out: dict[str, tuple[int, ...]] = {}
    for rid in num_scheduled:
        request = requests[rid]
        todo = []
        for k in enc.needs.get(rid, ()):
            f = request.mm_features[k]
            if f.identifier not in cache:
                cache.allocate(f.identifier, f.length)
                todo.append(k)
        if todo:
            out[rid] = tuple(todo)
    return out, cache.end_step()
