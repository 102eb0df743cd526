"""Chooses which processes hold the peer replicas of each process's memory tier.

Placement is a pure function of the failure-domain layout, so every process
computes the same answer without talking to the others. It never places a
replica in its owner's failure domain, balances how many replicas each process
holds (memory on the holder's tmpfs), and, where balance allows, spreads each
owner's replicas over distinct domains.

A failure domain may be a path of levels, widest first, split on ``/``
(``"zone-a/rack-3/host-17"``). The whole path is the owner's own domain (its
host): no copy ever goes there, the one hard rule, as with flat domains.
Beyond it each copy goes as far from its owner as balance allows: every
owner's first copy into another subtree at the widest level (another zone),
each further copy into a subtree that holds neither the owner nor an earlier
copy, at the widest level where one is left (another zone while one is left,
else another rack, else another host). Where the subtrees of each level have
equal sizes, the owner and its k copies lie in min(k + 1, zones) zones,
min(k + 1, racks) racks and k + 1 hosts, and every process holds exactly k
copies. Balance comes first: no holder takes more copies than the least
possible busiest holder (the bound of flat domains), so where a zone has more
processes than the rest can take copies of, some of its copies stay in it, in
another rack; with one rack only, copies go to other hosts. A domain without
``/`` is a path of one level, and its placement is what it always was.
"""

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

Path = tuple[str, ...]


def domain_path(domain: str) -> Path:
    """The levels of a failure domain, widest first (``"zone-a/rack-3"`` -> zone, rack)."""
    return tuple(domain.split("/"))


def shared_levels(a: Path, b: Path) -> int:
    """How many levels, from the widest, two failure-domain paths have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _nearer(path: Path, than: Path, owner: Path) -> bool:
    """Whether `path` shares more levels with `owner` than `than` does."""
    return shared_levels(path, owner) > shared_levels(than, owner)


def _interleave(
    procs: list[int], paths: Sequence[Path] | Mapping[int, Path], level: int = 0
) -> list[int]:
    """`procs` on a ring that alternates their subtrees at `level` (largest first,
    round-robin), each subtree's members interleaved the same way one level down;
    the processes of one domain (one path) keep process order."""
    if all(paths[p] == paths[procs[0]] for p in procs):
        return list(procs)
    groups: dict[str | None, list[int]] = {}
    for p in procs:
        groups.setdefault(paths[p][level] if level < len(paths[p]) else None, []).append(p)
    # A process whose path ends at `level` (None) is a domain of its own: process order.
    rings = [g if key is None else _interleave(g, paths, level + 1) for key, g in groups.items()]
    rings.sort(key=lambda ring: (-len(ring), ring[0]))
    return [r[i] for i in range(len(rings[0])) for r in rings if i < len(r)]


def place_replicas(
    domains: Sequence[str],
    replicas: int,
    preferred: Sequence[Sequence[int]] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Chooses the peers that hold copies of each process's data.

    With `preferred` (data-parallel layouts: ``preferred[p]`` lists the
    processes that hold the same shards as ``p`` in other replicas,
    `_replicas.partners`), each owner first takes, in that order, preferred
    processes outside its failure domain (at most one per domain, none above
    the lower bound on the busiest holder's load), and those choices are kept:
    a holder that already has the rest of the shard in memory makes a restart
    read nothing over the network. The remaining replicas are placed as below.

    The processes are laid out on a ring that interleaves the failure domains
    (largest domain first, round-robin; with levels, the zones, each zone's
    racks interleaved the same way inside it, and so on), and each owner walks
    the ring from its own position, taking the first candidates outside its
    domain: first in subtrees at the widest level that hold neither the owner
    nor one of its copies (one per domain, flat) and none above the lower bound
    on the busiest holder's load, then relaxing those preferences in turn, a
    level at a time. With levels, owners in the biggest zones (then racks) go
    first and every owner takes its first copy before any takes its second.
    When every domain has the same size this already gives each process
    exactly ``replicas`` replicas to hold. Otherwise load is then evened out by
    moving replicas along paths from the busiest holders to holders with at
    least two fewer, until no such path exists, which minimises the busiest
    holder's load; with levels, first only by moves that take no copy nearer
    its owner.

    The answer depends only on the arguments (never on hash seeds or on which
    process asks), so every process computes the same placement.

    Args:
      domains: ``domains[p]`` is the failure domain of process ``p``: a
        hostname, or a path such as ``"zone-a/rack-3/host-17"``.
      replicas: How many copies of each process's data other processes hold.
      preferred: ``preferred[p]``, the processes to take first as ``p``'s
        holders where the constraints allow (None: none preferred).

    Returns:
      ``holders`` where ``holders[p]`` lists the ``replicas`` distinct processes
      that hold copies of process ``p``'s data, none of them ``p`` or in ``p``'s
      failure domain.

    Raises:
      ValueError: If ``replicas`` is negative, a domain is not a non-empty
        string, or some process has fewer than ``replicas`` processes outside
        its failure domain.
    """
    domains = list(domains)
    n = len(domains)
    members = _members_checked(domains, replicas)
    if replicas == 0 or n == 0:
        return tuple(() for _ in range(n))

    # Every holder carries `replicas` on average, and the owners of a domain
    # of size s can only use the n - s processes outside it.
    load_bound = max(
        replicas, *(math.ceil(len(m) * replicas / (n - len(m))) for m in members.values())
    )
    paths = [domain_path(d) for d in domains]
    depth = max(len(path) for path in paths)
    ring = _interleave(list(range(n)), paths)

    load = [0] * n
    holders: list[list[int]] = [[] for _ in range(n)]
    # (owner, holder) pairs kept out of the balancing
    fixed = _take_preferred(preferred or (), domains, holders, load, replicas, load_bound)
    _take_in_order(ring, paths, domains, holders, load, replicas, load_bound)
    if depth > 1:  # first without moving any copy nearer its owner
        _balance(domains, ring, holders, load, fixed, paths)
    _balance(domains, ring, holders, load, fixed)
    return tuple(tuple(h) for h in holders)


def _members_checked(domains: list[str], replicas: int) -> dict[str, list[int]]:
    """The processes of each failure domain, in order, once the arguments are checked
    (see `place_replicas`'s Raises)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative int, got {replicas!r}.")
    for p, domain in enumerate(domains):
        if not isinstance(domain, str) or not domain:
            raise ValueError(
                f"The failure domain of process {p} must be a non-empty str, got {domain!r}."
            )
    # IMPORTANT: dicts and lists only. Iterating a set of str depends on
    # PYTHONHASHSEED, which would give each process a different placement.
    members: dict[str, list[int]] = {}
    for p, domain in enumerate(domains):
        members.setdefault(domain, []).append(p)
    for domain, procs in members.items():
        outside = len(domains) - len(procs)
        if replicas and outside < replicas:
            raise ValueError(
                f"replicas={replicas} needs at least {replicas} processes outside failure "
                f"domain {domain!r} for process {procs[0]}, but only {outside} exist; "
                "lower TierOptions.replicas or spread processes over more failure domains."
            )
    return members


def _take_in_order(
    ring: list[int],
    paths: list[tuple[str, ...]],
    domains: list[str],
    holders: list[list[int]],
    load: list[int],
    replicas: int,
    load_bound: int,
) -> None:
    """Each owner's copies taken walking the ring, the most constrained owners first."""
    n, depth = len(ring), max(len(path) for path in paths)
    position_of = {p: i for i, p in enumerate(ring)}
    # Most constrained owners first: those in big subtrees (widest level first)
    # have few candidates outside them.
    sizes = collections.Counter(path[:i] for path in paths for i in range(1, len(path) + 1))
    constrained = {path: tuple(-sizes[path[:i]] for i in range(1, len(path) + 1)) for path in paths}
    passes = [(s, load_bound) for s in range(depth + 1)] + [(depth, n)]
    owners = sorted(ring, key=lambda p: constrained[paths[p]])
    # With levels, every owner places its first copy before any its second, so
    # that the first owners do not spend the far subtrees' room on their second.
    for count in range(1, replicas + 1) if depth > 1 else (replicas,):
        for owner in owners:
            chosen = holders[owner]
            _take(owner, ring, position_of[owner], paths, domains, chosen, load, passes, count)


def _take_preferred(
    preferred: Sequence[Sequence[int]],
    domains: Sequence[str],
    holders: list[list[int]],
    load: list[int],
    replicas: int,
    load_bound: int,
) -> set[tuple[int, int]]:
    """Gives each owner its `preferred` holders outside its domain, in order, one per
    domain and none above `load_bound` (whole domains compared, levels or not);
    the (owner, holder) pairs taken."""
    n = len(domains)
    fixed: set[tuple[int, int]] = set()
    for owner, candidates in enumerate(preferred):
        taken: set[str] = set()
        for c in candidates:
            if len(holders[owner]) == replicas:
                break
            if not 0 <= c < n or c == owner or c in holders[owner]:
                continue
            if domains[c] == domains[owner] or domains[c] in taken or load[c] >= load_bound:
                continue
            holders[owner].append(c)
            taken.add(domains[c])
            load[c] += 1
            fixed.add((owner, c))
    return fixed


def _take(
    owner: int,
    ring: Sequence[int],
    position: int,
    paths: Sequence[Path],
    domains: Sequence[str],
    chosen: list[int],
    load: list[int],
    passes: Sequence[tuple[int, int]],
    replicas: int,
) -> None:
    """Fills `owner`'s `chosen` up to `replicas` holders, walking the ring from the
    owner's `position` once a pass: a pass (levels, limit) takes the candidates
    outside the owner's domain that share at most `levels` levels with the owner
    and with every copy so far, and hold fewer than `limit` copies."""
    n = len(ring)
    for levels, limit in passes:
        # The subtrees at `levels` (path prefixes) that the owner or a copy is in.
        taken = {paths[p][: levels + 1] for p in (owner, *chosen) if len(paths[p]) > levels}
        for step in range(1, n):
            if len(chosen) == replicas:
                return
            c = ring[(position + step) % n]
            if domains[c] == domains[owner] or c in chosen or load[c] >= limit:
                continue
            if len(paths[c]) > levels and paths[c][: levels + 1] in taken:
                continue
            chosen.append(c)
            if len(paths[c]) > levels:
                taken.add(paths[c][: levels + 1])
            load[c] += 1


def _balance(
    domains: list[str],
    ring: list[int],
    holders: list[list[int]],
    load: list[int],
    fixed: AbstractSet[tuple[int, int]] = frozenset(),
    paths: Sequence[Path] | None = None,
) -> None:
    """Evens out holder loads in place by moving replicas along augmenting paths.

    A path starts at a holder with load ``level``, passes through holders with
    load ``level - 1`` and ends at one with at most ``level - 2``; each hop hands
    one owner's replica to the next holder. Applying it lowers the first holder
    by one, raises the last by one and leaves the others unchanged, so the sum
    of squared loads drops. When no path exists at any level, the loads are as
    even as the domain constraints allow (in particular the busiest holder
    holds as few replicas as possible).

    With `paths`, a hop never moves a copy nearer its owner (to a holder that
    shares more levels of the owner's failure-domain path).
    """
    held: list[list[int]] = [[] for _ in load]
    for owner, hs in enumerate(holders):
        for h in hs:
            if (owner, h) not in fixed:  # a preferred copy never moves
                held[h].append(owner)
    improved = True
    while improved:
        improved = False
        for level in range(max(load), min(load) + 1, -1):
            while _augment(level, domains, ring, holders, held, load, paths):
                improved = True


def _augment(
    level: int,
    domains: list[str],
    ring: list[int],
    holders: list[list[int]],
    held: list[list[int]],
    load: list[int],
    paths: Sequence[Path] | None,
) -> bool:
    """Finds and applies one augmenting path from a holder at ``level``; False if none."""
    starts = [h for h in ring if load[h] == level]
    # Unvisited holders below `level`, by domain, so an owner skips its own
    # domain in one step instead of one holder at a time.
    free: dict[str, list[int]] = {}
    for h in ring:
        if load[h] < level:
            free.setdefault(domains[h], []).append(h)
    came_from: dict[int, tuple[int, int] | None] = dict.fromkeys(starts)
    queue = collections.deque(starts)
    while queue:
        h = queue.popleft()
        for owner in held[h]:
            for domain in list(free):
                if domain == domains[owner]:
                    continue
                if paths and _nearer(paths[free[domain][0]], paths[h], paths[owner]):
                    continue
                kept = []
                for h2 in free.pop(domain):
                    if h2 in holders[owner] or h2 in came_from:
                        kept.append(h2)
                        continue
                    came_from[h2] = (h, owner)
                    if load[h2] <= level - 2:
                        _apply(h2, came_from, holders, held, load)
                        return True
                    queue.append(h2)
                if kept:
                    free[domain] = kept
    return False


def _apply(
    end: int,
    came_from: dict[int, tuple[int, int] | None],
    holders: list[list[int]],
    held: list[list[int]],
    load: list[int],
) -> None:
    """Moves one replica along each hop of the path that ends at ``end``."""
    load[end] += 1
    h2 = end
    while (hop := came_from[h2]) is not None:
        h, owner = hop
        holders[owner][holders[owner].index(h)] = h2
        held[h].remove(owner)
        held[h2].append(owner)
        h2 = h
    load[h2] -= 1


def partner_holders(
    owner: int,
    partners: Sequence[int],
    domain_of: Callable[[int], str],
    placed: Sequence[int],
    replicas: int,
    process_count: int,
) -> tuple[int, ...]:
    """One owner's holders in a data-parallel layout, from what that owner knows (pure).

    Its `partners` (the processes holding the same shards in other replicas,
    `_replicas.partners`) come first, tried in ring order after the owner so that
    where every process is a partner (a replicated leaf) the copies spread evenly,
    each taken only in a failure domain of its own outside the owner's; the
    holders `placed` at the run's set-up fill the rest, those in unused domains
    first. Every process computes its own holders alike from the same inputs;
    no process needs every domain.

    With failure-domain paths the ring is the one `place_replicas` lays out
    (over the owner and its partners: alike on each of them), and copies go to
    the widest level first: level by level, a partner is taken where it shares
    no more than that many levels with the owner and every copy so far, then a
    set-up holder where it shares no more with the owner and the partners
    taken; the set-up's holders fill the rest. A partner in the owner's rack
    thus never displaces a set-up holder in another zone.

    Args:
      owner: the process whose copies are placed.
      partners: its partners.
      domain_of: a process's failure domain (the owner's included).
      placed: the owner's holders as the set-up placed them (`place_replicas`).
      replicas: how many holders to choose.
      process_count: how many processes there are (the ring's size).

    Returns:
      At most `replicas` distinct holders, none of them the owner.
    """
    paths: dict[int, Path] = {q: domain_path(domain_of(q)) for q in (owner, *partners)}
    depth = max(len(path) for path in paths.values())
    if depth == 1:  # the ring in process order
        count = max(process_count, owner + 1, *(q + 1 for q in partners))
        ring = sorted({owner, *partners}, key=lambda q: (q - owner) % count)
    else:
        ring = _interleave(sorted({owner, *partners}), paths)
        ring = ring[ring.index(owner) :] + ring[: ring.index(owner)]

    def shares(p: int, others: Sequence[int], levels: int) -> bool:
        if p not in paths:
            paths[p] = domain_path(domain_of(p))
        return any(shared_levels(paths[p], paths[o]) > levels for o in others)

    chosen: list[int] = []
    taken = [owner]  # the owner and the partners taken
    for levels in range(depth):
        for q in ring[1:]:
            if len(chosen) == replicas or q in chosen or paths[q] == paths[owner]:
                continue
            if not shares(q, [owner, *chosen], levels):
                chosen.append(q)
                taken.append(q)
        spread = [h for h in placed if h not in chosen and h != owner]
        chosen += [h for h in spread if not shares(h, taken, levels)][: replicas - len(chosen)]
    chosen += [h for h in placed if h not in chosen and h != owner][: replicas - len(chosen)]
    return tuple(chosen)
