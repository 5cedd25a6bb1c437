/* The timing engine's walk (schedules/engine.py says what it computes and why).

   Inputs and outputs are flat arrays (buffers of int64, int8 or float64) that
   schedules/engine.py builds from a schedule and a StepTiming; nothing here knows an
   action's text. The walk: each rank runs through its items as far as what is known
   allows; the moments at which the order across ranks matters (a rendezvous group
   starts, a buffered or free transfer leaves: both reserve links) go through one heap
   and are taken in time order, ties in rank order, then in the order they were posted
   (a group by its number: a rank's groups are numbered in the order it posts them, and
   a group reaches the heap only once its stream is free, which can be after a later
   group of the same rank on another stream did).
   Every such moment is at or after the one being taken, so links are reserved in true
   time order. A rank that needs what has not happened yet stops and is resumed by the
   moment that provides it.
   Each rank's data-parallel channel (schedules/dp_channel.py) serves its collectives in
   channel order: a collective is issued when its rank runs the backward that releases it
   (or ends its step), and its start is a moment of the same heap, taken after every P2P
   moment of the same time (its own tier), so its links too are reserved in time order.
   The parameter gathers (ZeRO-1 and 2 under the next step's forwards) are issued at the
   step's start, first on each channel; a stage's first forward waits until its last
   layer's gather has taken its links (its end is then known), and is held to start no
   earlier than its first layer's gather's end and to end no earlier than its last one's
   end plus one layer's share of the forward. That start can lie before the moment the
   walk learns it, but nothing of the rank happens before the forward's end, which does
   not: the moments the rank then posts are still in time order. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { RENDEZVOUS = 0, BUFFERED = 1, FREE = 2 };
enum { GROUP_START = 0, DEPARTURE = 1, COLLECTIVE_START = 2 };
enum { P2P_TIER = 0, CHANNEL_TIER = 1 }; /* at one moment, P2P transfers take their links before collectives */
enum { AT_FRACTION = 0, AT_BACKWARD_END = 1, AT_STEP_END = 2, AT_STEP_START = 3, AT_ACTION = 4 }; /* when a collective is issued */
enum { ALL_GROUPS = -2 }; /* what a rank at the end of its program waits for: every group it posted */

typedef struct {
    double time;
    int64_t tier;  /* P2P_TIER or CHANNEL_TIER: ties after time */
    int64_t rank;
    int64_t order; /* posting order (a group's number): ties after time and rank */
    int64_t what;  /* GROUP_START or DEPARTURE */
    int64_t id;    /* the group or the transfer */
} Moment;

typedef struct {
    Moment *items;
    Py_ssize_t size, capacity;
} Heap;

static int moment_before(const Moment *a, const Moment *b) {
    if (a->time != b->time) return a->time < b->time;
    if (a->tier != b->tier) return a->tier < b->tier;
    if (a->rank != b->rank) return a->rank < b->rank;
    return a->order < b->order;
}

static int heap_push(Heap *heap, Moment moment) {
    if (heap->size == heap->capacity) {
        Py_ssize_t capacity = heap->capacity ? 2 * heap->capacity : 256;
        Moment *grown = realloc(heap->items, (size_t)capacity * sizeof(Moment));
        if (!grown) return -1;
        heap->items = grown;
        heap->capacity = capacity;
    }
    Py_ssize_t at = heap->size++;
    while (at > 0) {
        Py_ssize_t parent = (at - 1) / 2;
        if (!moment_before(&moment, &heap->items[parent])) break;
        heap->items[at] = heap->items[parent];
        at = parent;
    }
    heap->items[at] = moment;
    return 0;
}

static Moment heap_pop(Heap *heap) {
    Moment top = heap->items[0];
    Moment last = heap->items[--heap->size];
    Py_ssize_t at = 0;
    for (;;) {
        Py_ssize_t child = 2 * at + 1;
        if (child >= heap->size) break;
        if (child + 1 < heap->size && moment_before(&heap->items[child + 1], &heap->items[child])) child++;
        if (!moment_before(&heap->items[child], &last)) break;
        heap->items[at] = heap->items[child];
        at = child;
    }
    if (heap->size > 0) heap->items[at] = last;
    return top;
}

/* The inputs, in the order of schedules/engine.py's EngineInputs (INPUT_NAMES below). */
enum {
    IN_RANK_ITEM_START, IN_ITEM_IS_GROUP, IN_ITEM_REF, IN_SECONDS, IN_HOLD, IN_NEED, IN_SEND, IN_BLOCKED, IN_PAIR,
    IN_GROUP_ENDPOINT_START, IN_GROUP_RANK, IN_GROUP_STREAM, IN_STREAM_GROUP_START, IN_STREAM_GROUPS,
    IN_ENDPOINT_TRANSFER, IN_ENDPOINT_IS_SEND, IN_TRANSFER_WIRE, IN_ROUTE_START, IN_LINK_START, IN_LINKS,
    IN_OCCUPANCY, IN_LATENCY, IN_CHANNEL_START, IN_COLLECTIVE_MODE, IN_COLLECTIVE_FRACTION, IN_COLLECTIVE_RUN,
    IN_RUN_OFFSET_START, IN_RUN_OFFSETS, IN_COLLECTIVE_STAGE, IN_STAGE_LINK_START, IN_STAGE_LINKS, IN_ROW_COLLECTIVE_START, IN_ROW_COLLECTIVES,
    IN_GATE_FIRST, IN_GATE_LAST, IN_COUNT
};
enum {
    OUT_READY, OUT_START, OUT_END, OUT_POSTED, OUT_DEPARTED, OUT_ARRIVAL, OUT_GROUP_POSTED, OUT_GROUP_START,
    OUT_GROUP_DONE, OUT_RANK_CLOCK, OUT_RANK_DONE, OUT_STUCK_ITEM, OUT_COLLECTIVE_READY, OUT_COLLECTIVE_START,
    OUT_COLLECTIVE_END, OUT_COUNT
};

typedef struct {
    int semantics;
    double overhead;
    Py_ssize_t ranks, transfers;
    /* inputs */
    const int64_t *rank_item_start, *item_ref, *need, *send, *pair, *group_endpoint_start, *group_rank, *group_stream,
        *stream_group_start, *stream_groups, *endpoint_transfer, *transfer_wire, *route_start, *link_start, *links,
        *channel_start, *collective_stage, *stage_link_start, *stage_links, *row_collective_start, *row_collectives,
        *gate_first, *gate_last,
        *collective_run, *run_offset_start;
    const int8_t *item_is_group, *blocked, *endpoint_is_send, *collective_mode;
    const double *seconds, *hold, *occupancy, *latency, *collective_fraction, *run_offsets;
    /* outputs */
    double *ready, *start, *end, *posted, *departed, *arrival, *group_posted, *group_start, *group_done, *rank_clock,
        *rank_done, *collective_ready, *collective_start, *collective_end;
    int64_t *stuck_item;
    /* state */
    double *link_free;
    int64_t *position;       /* per rank: the item it stands at */
    double *clock;           /* per rank: the host's clock */
    int64_t *waits_group;    /* per rank: the group it waits for, -1 */
    int64_t *waits_transfer; /* per rank: the transfer it waits for, -1 */
    int64_t *waits_collective; /* per rank: the parameter gather whose end it waits to know, -1 */
    /* a P2P stream runs its groups (stream_groups[stream_group_start[s]..]) in posting order */
    int64_t *posted_groups;  /* per stream: how many of its groups were posted */
    int64_t *started_groups; /* per stream: how many of them it has started */
    int8_t *stream_busy;
    double *stream_free;     /* per stream: when its last group completed */
    int64_t *open_groups;    /* per rank: groups posted and not completed */
    double *last_done;       /* per rank: its latest group completion */
    int64_t *offer;          /* per transfer: the endpoint whose group started first, -1 */
    int64_t *waiter;         /* per transfer: the rank waiting for its arrival, -1 */
    int64_t *outstanding;    /* per group: transfers not yet paired */
    double *latest;          /* per group: its latest arrival so far */
    int64_t *endpoint_group; /* per endpoint: its group */
    int64_t *channel_next;   /* per rank: the next collective its channel serves */
    int8_t *channel_busy;    /* per rank: its next collective's start is in the heap */
    double *channel_free;    /* per rank: when its channel's last collective ended */
    int64_t *channel_bucket; /* per rank: the bucket of its running collective that comes next */
    double *channel_base;    /* per rank: its running collective's start, plus what transfers delayed it by */
    Heap heap;
    int64_t order;
} Engine;

static int push(Engine *e, double time, int64_t rank, int64_t order, int64_t what, int64_t id) {
    Moment moment = {time, what == COLLECTIVE_START ? CHANNEL_TIER : P2P_TIER, rank, order, what, id};
    return heap_push(&e->heap, moment);
}

static int advance(Engine *e, int64_t rank);

/* Put the channel's next collective in the heap once it is issued and the channel idle:
   at its issue, or when the collective before it ended if that is later. */
static int serve_channel(Engine *e, int64_t rank) {
    int64_t collective = e->channel_next[rank];
    if (e->channel_busy[rank] || collective >= e->channel_start[rank + 1] || isnan(e->collective_ready[collective]))
        return 0;
    e->channel_busy[rank] = 1;
    double at = e->collective_ready[collective];
    if (e->channel_free[rank] > at) at = e->channel_free[rank];
    return push(e, at, rank, collective, COLLECTIVE_START, collective);
}

/* A collective's next bucket starts once every link it crosses is free, and holds them
   all until it ends; a transfer that took one of them since the bucket before delays it
   and every later bucket of the run. The last bucket ends the collective. */
static int start_collective(Engine *e, int64_t rank, int64_t collective, double now) {
    int64_t stage = e->collective_stage[collective];
    int64_t first = e->stage_link_start[stage], stop = e->stage_link_start[stage + 1];
    double begin = now;
    for (int64_t at = first; at < stop; at++)
        if (e->link_free[e->stage_links[at]] > begin) begin = e->link_free[e->stage_links[at]];
    int64_t bucket = e->channel_bucket[rank], run = e->collective_run[collective];
    if (bucket == 0) {
        e->collective_start[collective] = begin;
        e->channel_base[rank] = begin;
    } else if (begin > now) {
        e->channel_base[rank] += begin - now;
    }
    int64_t offset = e->run_offset_start[run] + bucket;
    double done = e->channel_base[rank] + e->run_offsets[offset];
    for (int64_t at = first; at < stop; at++) e->link_free[e->stage_links[at]] = done;
    if (offset + 1 < e->run_offset_start[run + 1]) {
        e->channel_bucket[rank] = bucket + 1;
        return push(e, done, rank, collective, COLLECTIVE_START, collective);
    }
    e->collective_end[collective] = done;
    e->channel_free[rank] = done;
    e->channel_bucket[rank] = 0;
    e->channel_next[rank]++;
    e->channel_busy[rank] = 0;
    if (serve_channel(e, rank) < 0) return -1;
    if (e->waits_collective[rank] == collective) { /* a forward waited to know its gathers' end */
        e->waits_collective[rank] = -1;
        return advance(e, rank);
    }
    return 0;
}

/* Compute row ``compute`` ran from ``start`` to ``end``: issue the collectives it releases. */
static int issue_released(Engine *e, int64_t rank, int64_t compute, double start, double end) {
    int64_t first = e->row_collective_start[compute], stop = e->row_collective_start[compute + 1];
    if (first == stop) return 0;
    for (int64_t at = first; at < stop; at++) {
        int64_t collective = e->row_collectives[at];
        if (e->collective_mode[collective] == AT_FRACTION) {
            double span = end - start;
            double share = e->collective_fraction[collective] * span;
            e->collective_ready[collective] = start + share;
        } else {
            e->collective_ready[collective] = end;
        }
    }
    return serve_channel(e, rank);
}

/* The rank's step is done at ``done``: issue the collectives that wait for it. */
static int issue_at_step_end(Engine *e, int64_t rank, double done) {
    int issued = 0;
    for (int64_t collective = e->channel_start[rank]; collective < e->channel_start[rank + 1]; collective++)
        if (e->collective_mode[collective] == AT_STEP_END) {
            e->collective_ready[collective] = done;
            issued = 1;
        }
    return issued ? serve_channel(e, rank) : 0;
}

/* The step starts: issue the parameter gathers, at its first moment. */
static int issue_at_step_start(Engine *e, int64_t rank) {
    int issued = 0;
    for (int64_t collective = e->channel_start[rank]; collective < e->channel_start[rank + 1]; collective++)
        if (e->collective_mode[collective] == AT_STEP_START) {
            e->collective_ready[collective] = 0.0;
            issued = 1;
        }
    return issued ? serve_channel(e, rank) : 0;
}

/* ZeRO-3: the rank reached ``compute`` with its input there at ``now``: issue its layers'
   gathers, once (ZeRO-1/2's were issued at the step's start). */
static int issue_at_action(Engine *e, int64_t rank, int64_t compute, double now) {
    int64_t first = e->gate_first[compute], last = e->gate_last[compute];
    if (e->collective_mode[first] != AT_ACTION || !isnan(e->collective_ready[first])) return 0;
    for (int64_t collective = first; collective <= last; collective++) e->collective_ready[collective] = now;
    return serve_channel(e, rank);
}

/* Whether the action ``compute`` knows when its parameter gathers end; if not, the rank
   now waits to know. Moves the clock to the action's start when it does. */
static int gathered(Engine *e, int64_t rank, int64_t compute, double *clock) {
    int64_t last = e->gate_last[compute];
    if (last < 0) return 1;
    if (issue_at_action(e, rank, compute, *clock) < 0) return -1;
    double last_end = e->collective_end[last];
    if (isnan(last_end)) {
        e->waits_collective[rank] = last;
        return 0;
    }
    int64_t first = e->gate_first[compute];
    double first_end = e->collective_end[first];
    double seconds = e->seconds[compute];
    double layers = (double)(last - first + 1);
    double share = seconds / layers;
    double held = last_end + share - seconds;
    if (first_end > *clock) *clock = first_end;
    if (held > *clock) *clock = held;
    return 1;
}

/* Reserve the links of every route of ``wire`` at ``now``; the arrival (the last route's). */
static double reserve(Engine *e, int64_t wire, double now) {
    double arrival = now;
    for (int64_t route = e->route_start[wire]; route < e->route_start[wire + 1]; route++) {
        int64_t first = e->link_start[route], stop = e->link_start[route + 1];
        if (first == stop) continue; /* no links: there at once */
        double begin = now;
        for (int64_t at = first; at < stop; at++)
            if (e->link_free[e->links[at]] > begin) begin = e->link_free[e->links[at]];
        double done = begin + e->occupancy[route];
        for (int64_t at = first; at < stop; at++) e->link_free[e->links[at]] = done;
        if (done + e->latency[route] > arrival) arrival = done + e->latency[route];
    }
    return arrival;
}

/* Start the stream's next posted group once the one before it has completed. */
static int schedule_next(Engine *e, int64_t stream) {
    if (e->started_groups[stream] == e->posted_groups[stream]) {
        e->stream_busy[stream] = 0;
        return 0;
    }
    int64_t group = e->stream_groups[e->stream_group_start[stream] + e->started_groups[stream]++];
    e->stream_busy[stream] = 1;
    double begin = e->group_posted[group] > e->stream_free[stream] ? e->group_posted[group] : e->stream_free[stream];
    e->group_start[group] = begin;
    return push(e, begin, e->group_rank[group], group, GROUP_START, group);
}

static int complete(Engine *e, int64_t group) {
    double done = e->group_start[group] > e->latest[group] ? e->group_start[group] : e->latest[group];
    int64_t rank = e->group_rank[group], stream = e->group_stream[group];
    e->group_done[group] = done;
    e->stream_free[stream] = done;
    e->open_groups[rank]--;
    if (done > e->last_done[rank]) e->last_done[rank] = done;
    if (schedule_next(e, stream) < 0) return -1;
    if (e->waits_group[rank] == group || (e->waits_group[rank] == ALL_GROUPS && e->open_groups[rank] == 0)) {
        e->waits_group[rank] = -1;
        return advance(e, rank);
    }
    return 0;
}

/* A rendezvous group starts: pair each of its transfers with a peer group that already
   started (the later start sends it), or leave it on offer. */
static int begin_group(Engine *e, int64_t group) {
    double now = e->group_start[group];
    for (int64_t endpoint = e->group_endpoint_start[group]; endpoint < e->group_endpoint_start[group + 1];
         endpoint++) {
        int64_t transfer = e->endpoint_transfer[endpoint];
        int64_t peer = e->offer[transfer];
        if (peer < 0) {
            e->offer[transfer] = endpoint;
            e->outstanding[group]++;
            continue;
        }
        int64_t peer_group = e->endpoint_group[peer];
        int64_t sender = e->endpoint_is_send[endpoint] ? group : peer_group;
        double arrival = reserve(e, e->transfer_wire[transfer], now);
        e->posted[transfer] = e->group_posted[sender];
        e->departed[transfer] = now;
        e->arrival[transfer] = arrival;
        if (arrival > e->latest[group]) e->latest[group] = arrival;
        if (arrival > e->latest[peer_group]) e->latest[peer_group] = arrival;
        if (--e->outstanding[peer_group] == 0 && complete(e, peer_group) < 0) return -1;
    }
    if (e->outstanding[group] == 0) return complete(e, group);
    return 0;
}

static int depart(Engine *e, int64_t transfer, double now) {
    e->departed[transfer] = now;
    e->arrival[transfer] = reserve(e, e->transfer_wire[transfer], now);
    int64_t rank = e->waiter[transfer];
    if (rank >= 0) {
        e->waiter[transfer] = -1;
        e->waits_transfer[rank] = -1;
        return advance(e, rank);
    }
    return 0;
}

static int post_transfer(Engine *e, int64_t rank, int64_t transfer, double now) {
    e->posted[transfer] = now;
    return push(e, now, rank, e->order++, DEPARTURE, transfer);
}

/* Whether compute action ``compute`` of ``rank`` has its input; if not, the rank now
   waits for it. Moves the clock past it when it is there. */
static int input_there(Engine *e, int64_t rank, int64_t compute, double *clock) {
    int64_t needed = e->need[compute];
    if (needed < 0) return 1;
    double moment = e->semantics == RENDEZVOUS ? e->group_done[needed] : e->arrival[needed];
    if (isnan(moment)) {
        if (e->semantics == RENDEZVOUS) {
            e->waits_group[rank] = needed;
        } else {
            e->waits_transfer[rank] = needed;
            e->waiter[needed] = rank;
        }
        return 0;
    }
    if (moment > *clock) *clock = moment;
    return 1;
}

/* Run ``rank`` until it needs something that has not happened, or to its end. */
static int advance(Engine *e, int64_t rank) {
    int64_t item = e->position[rank], stop = e->rank_item_start[rank + 1];
    double clock = e->clock[rank];
    for (; item < stop; item++) {
        int64_t ref = e->item_ref[item];
        if (!e->item_is_group[item]) {
            if (isnan(e->ready[ref])) e->ready[ref] = clock;
            if (e->blocked[ref]) break; /* its same-rank input comes later: never */
            if (!input_there(e, rank, ref, &clock)) break;
            /* the forward half of an overlapped pair starts with both halves' inputs there */
            int64_t partner = e->pair[ref];
            if (partner > ref && !input_there(e, rank, partner, &clock)) break;
            int known = gathered(e, rank, ref, &clock);
            if (known < 0) return -1;
            if (!known) break;
            e->start[ref] = clock;
            clock += e->seconds[ref];
            e->end[ref] = clock;
            if (issue_released(e, rank, ref, e->start[ref], clock) < 0) return -1;
            clock += e->hold[ref];
            /* and both halves' outputs leave when the pair ends */
            if (partner >= 0 && partner < ref && e->send[partner] >= 0 &&
                post_transfer(e, rank, e->send[partner], clock) < 0)
                return -1;
            if (e->send[ref] >= 0 && !(partner > ref) && post_transfer(e, rank, e->send[ref], clock) < 0) return -1;
            continue;
        }
        int64_t first = e->group_endpoint_start[ref], last = e->group_endpoint_start[ref + 1];
        if (e->semantics == RENDEZVOUS) {
            int64_t stream = e->group_stream[ref];
            clock += e->overhead * (double)(last - first);
            e->group_posted[ref] = clock;
            e->posted_groups[stream]++;
            e->open_groups[rank]++;
            if (!e->stream_busy[stream] && schedule_next(e, stream) < 0) return -1;
            continue;
        }
        for (int64_t endpoint = first; endpoint < last; endpoint++) { /* sends leave as they are posted */
            if (!e->endpoint_is_send[endpoint]) continue;
            clock += e->overhead;
            if (post_transfer(e, rank, e->endpoint_transfer[endpoint], clock) < 0) return -1;
        }
        for (int64_t endpoint = first; endpoint < last; endpoint++)
            if (!e->endpoint_is_send[endpoint]) clock += e->overhead;
        e->group_posted[ref] = clock;
    }
    e->position[rank] = item;
    e->clock[rank] = clock;
    if (item < stop) return 0;
    e->rank_clock[rank] = clock;
    if (e->semantics == RENDEZVOUS) {
        if (e->open_groups[rank] > 0) { /* the step ends with its last transfers */
            e->waits_group[rank] = ALL_GROUPS;
            return 0;
        }
        e->rank_done[rank] = clock > e->last_done[rank] ? clock : e->last_done[rank];
        return issue_at_step_end(e, rank, e->rank_done[rank]);
    }
    e->rank_done[rank] = clock;
    return issue_at_step_end(e, rank, clock);
}

/* Buffer helpers: every array is checked for its element size and read as flat. */
static int get_buffer(PyObject *object, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *what) {
    if (PyObject_GetBuffer(object, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "engine: %s has items of %zd bytes, expected %zd", what, view->itemsize,
                     itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static const Py_ssize_t INPUT_SIZES[IN_COUNT] = {8, 1, 8, 8, 8, 8, 8, 1, 8, 8, 8, 8, 8, 8, 8, 1, 8, 8, 8, 8, 8, 8,
                                                 8, 1, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8};

static void *alloc_filled(Py_ssize_t count, size_t size, int value) {
    void *memory = malloc((size_t)(count > 0 ? count : 1) * size);
    if (memory) memset(memory, value, (size_t)(count > 0 ? count : 1) * size);
    return memory;
}

static PyObject *engine_run(PyObject *self, PyObject *args) {
    int semantics;
    double overhead;
    PyObject *inputs, *outputs;
    Py_ssize_t link_count;
    if (!PyArg_ParseTuple(args, "idO!nO!", &semantics, &overhead, &PyTuple_Type, &inputs, &link_count, &PyTuple_Type,
                          &outputs))
        return NULL;
    if (PyTuple_GET_SIZE(inputs) != IN_COUNT || PyTuple_GET_SIZE(outputs) != OUT_COUNT) {
        PyErr_SetString(PyExc_ValueError, "engine: wrong number of arrays");
        return NULL;
    }
    Py_buffer in[IN_COUNT], out[OUT_COUNT];
    int taken_in = 0, taken_out = 0;
    PyObject *result = NULL;
    Engine e;
    memset(&e, 0, sizeof(e));
    for (; taken_in < IN_COUNT; taken_in++)
        if (get_buffer(PyTuple_GET_ITEM(inputs, taken_in), &in[taken_in], INPUT_SIZES[taken_in], 0, "an input") < 0)
            goto done;
    for (; taken_out < OUT_COUNT; taken_out++)
        if (get_buffer(PyTuple_GET_ITEM(outputs, taken_out), &out[taken_out], 8, 1, "an output") < 0) goto done;

    e.semantics = semantics;
    e.overhead = overhead;
    e.ranks = in[IN_RANK_ITEM_START].len / 8 - 1;
    e.transfers = out[OUT_POSTED].len / 8;
    Py_ssize_t groups = in[IN_GROUP_RANK].len / 8, endpoints = in[IN_ENDPOINT_TRANSFER].len / 8;
    Py_ssize_t streams = in[IN_STREAM_GROUP_START].len / 8 - 1;
    if (in[IN_CHANNEL_START].len / 8 != e.ranks + 1) {
        PyErr_SetString(PyExc_ValueError, "engine: channel_start needs one entry per rank and one more");
        goto done;
    }
    e.rank_item_start = in[IN_RANK_ITEM_START].buf;
    e.item_is_group = in[IN_ITEM_IS_GROUP].buf;
    e.item_ref = in[IN_ITEM_REF].buf;
    e.seconds = in[IN_SECONDS].buf;
    e.hold = in[IN_HOLD].buf;
    e.need = in[IN_NEED].buf;
    e.send = in[IN_SEND].buf;
    e.blocked = in[IN_BLOCKED].buf;
    e.pair = in[IN_PAIR].buf;
    e.group_endpoint_start = in[IN_GROUP_ENDPOINT_START].buf;
    e.group_rank = in[IN_GROUP_RANK].buf;
    e.group_stream = in[IN_GROUP_STREAM].buf;
    e.stream_group_start = in[IN_STREAM_GROUP_START].buf;
    e.stream_groups = in[IN_STREAM_GROUPS].buf;
    e.endpoint_transfer = in[IN_ENDPOINT_TRANSFER].buf;
    e.endpoint_is_send = in[IN_ENDPOINT_IS_SEND].buf;
    e.transfer_wire = in[IN_TRANSFER_WIRE].buf;
    e.route_start = in[IN_ROUTE_START].buf;
    e.link_start = in[IN_LINK_START].buf;
    e.links = in[IN_LINKS].buf;
    e.occupancy = in[IN_OCCUPANCY].buf;
    e.latency = in[IN_LATENCY].buf;
    e.channel_start = in[IN_CHANNEL_START].buf;
    e.collective_mode = in[IN_COLLECTIVE_MODE].buf;
    e.collective_fraction = in[IN_COLLECTIVE_FRACTION].buf;
    e.collective_run = in[IN_COLLECTIVE_RUN].buf;
    e.run_offset_start = in[IN_RUN_OFFSET_START].buf;
    e.run_offsets = in[IN_RUN_OFFSETS].buf;
    e.collective_stage = in[IN_COLLECTIVE_STAGE].buf;
    e.stage_link_start = in[IN_STAGE_LINK_START].buf;
    e.stage_links = in[IN_STAGE_LINKS].buf;
    e.row_collective_start = in[IN_ROW_COLLECTIVE_START].buf;
    e.row_collectives = in[IN_ROW_COLLECTIVES].buf;
    e.gate_first = in[IN_GATE_FIRST].buf;
    e.gate_last = in[IN_GATE_LAST].buf;
    e.ready = out[OUT_READY].buf;
    e.start = out[OUT_START].buf;
    e.end = out[OUT_END].buf;
    e.posted = out[OUT_POSTED].buf;
    e.departed = out[OUT_DEPARTED].buf;
    e.arrival = out[OUT_ARRIVAL].buf;
    e.group_posted = out[OUT_GROUP_POSTED].buf;
    e.group_start = out[OUT_GROUP_START].buf;
    e.group_done = out[OUT_GROUP_DONE].buf;
    e.rank_clock = out[OUT_RANK_CLOCK].buf;
    e.rank_done = out[OUT_RANK_DONE].buf;
    e.stuck_item = out[OUT_STUCK_ITEM].buf;
    e.collective_ready = out[OUT_COLLECTIVE_READY].buf;
    e.collective_start = out[OUT_COLLECTIVE_START].buf;
    e.collective_end = out[OUT_COLLECTIVE_END].buf;

    e.link_free = alloc_filled(link_count, sizeof(double), 0);
    e.position = alloc_filled(e.ranks, sizeof(int64_t), 0);
    e.clock = alloc_filled(e.ranks, sizeof(double), 0);
    e.waits_group = alloc_filled(e.ranks, sizeof(int64_t), 0xff);
    e.waits_transfer = alloc_filled(e.ranks, sizeof(int64_t), 0xff);
    e.waits_collective = alloc_filled(e.ranks, sizeof(int64_t), 0xff);
    e.posted_groups = alloc_filled(streams, sizeof(int64_t), 0);
    e.started_groups = alloc_filled(streams, sizeof(int64_t), 0);
    e.stream_busy = alloc_filled(streams, sizeof(int8_t), 0);
    e.stream_free = alloc_filled(streams, sizeof(double), 0);
    e.open_groups = alloc_filled(e.ranks, sizeof(int64_t), 0);
    e.last_done = alloc_filled(e.ranks, sizeof(double), 0);
    e.offer = alloc_filled(e.transfers, sizeof(int64_t), 0xff);
    e.waiter = alloc_filled(e.transfers, sizeof(int64_t), 0xff);
    e.outstanding = alloc_filled(groups, sizeof(int64_t), 0);
    e.latest = alloc_filled(groups, sizeof(double), 0);
    e.endpoint_group = alloc_filled(endpoints, sizeof(int64_t), 0);
    e.channel_next = alloc_filled(e.ranks, sizeof(int64_t), 0);
    e.channel_busy = alloc_filled(e.ranks, sizeof(int8_t), 0);
    e.channel_free = alloc_filled(e.ranks, sizeof(double), 0);
    e.channel_bucket = alloc_filled(e.ranks, sizeof(int64_t), 0);
    e.channel_base = alloc_filled(e.ranks, sizeof(double), 0);
    if (!e.channel_next || !e.channel_busy || !e.channel_free || !e.channel_bucket || !e.channel_base ||!e.link_free || !e.position || !e.clock || !e.waits_group || !e.waits_transfer || !e.waits_collective || !e.posted_groups ||
        !e.started_groups || !e.stream_busy || !e.stream_free || !e.open_groups || !e.last_done || !e.offer ||
        !e.waiter || !e.outstanding || !e.latest || !e.endpoint_group) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < e.ranks; i++) e.clock[i] = 0.0;
    for (Py_ssize_t i = 0; i < link_count; i++) e.link_free[i] = 0.0;
    for (Py_ssize_t i = 0; i < groups; i++) e.latest[i] = 0.0;
    for (Py_ssize_t i = 0; i < streams; i++) e.stream_free[i] = 0.0;
    for (Py_ssize_t group = 0; group < groups; group++)
        for (int64_t at = e.group_endpoint_start[group]; at < e.group_endpoint_start[group + 1]; at++)
            e.endpoint_group[at] = group;
    for (Py_ssize_t rank = 0; rank < e.ranks; rank++) {
        e.position[rank] = e.rank_item_start[rank];
        e.last_done[rank] = 0.0;
        e.channel_next[rank] = e.channel_start[rank];
        e.channel_free[rank] = 0.0;
    }

    int failed = 0;
    for (Py_ssize_t rank = 0; rank < e.ranks && !failed; rank++) failed = issue_at_step_start(&e, rank) < 0;
    for (Py_ssize_t rank = 0; rank < e.ranks && !failed; rank++) failed = advance(&e, rank) < 0;
    while (!failed && e.heap.size > 0) {
        Moment moment = heap_pop(&e.heap);
        if (moment.what == GROUP_START)
            failed = begin_group(&e, moment.id) < 0;
        else if (moment.what == COLLECTIVE_START)
            failed = start_collective(&e, moment.rank, moment.id, moment.time) < 0;
        else
            failed = depart(&e, moment.id, moment.time) < 0;
    }
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t rank = 0; rank < e.ranks; rank++)
        e.stuck_item[rank] = isnan(e.rank_done[rank]) ? e.position[rank] - e.rank_item_start[rank] : -1;
    result = Py_None;
    Py_INCREF(result);

done:
    for (int i = 0; i < taken_in; i++) PyBuffer_Release(&in[i]);
    for (int i = 0; i < taken_out; i++) PyBuffer_Release(&out[i]);
    free(e.link_free);
    free(e.position);
    free(e.clock);
    free(e.waits_group);
    free(e.waits_transfer);
    free(e.waits_collective);
    free(e.open_groups);
    free(e.last_done);
    free(e.posted_groups);
    free(e.started_groups);
    free(e.stream_busy);
    free(e.stream_free);
    free(e.offer);
    free(e.waiter);
    free(e.outstanding);
    free(e.latest);
    free(e.endpoint_group);
    free(e.channel_next);
    free(e.channel_busy);
    free(e.channel_free);
    free(e.channel_bucket);
    free(e.channel_base);
    free(e.heap.items);
    return result;
}

/* The inputs' and outputs' names, in the enums' order: schedules/engine.py builds its
   EngineInputs by name and checks their order against these when it loads the module. */
static const char *const INPUT_NAMES[IN_COUNT] = {
    "rank_item_start", "item_is_group", "item_ref", "seconds", "hold", "need", "send", "blocked", "pair",
    "group_endpoint_start", "group_rank", "group_stream", "stream_group_start", "stream_groups",
    "endpoint_transfer", "endpoint_is_send", "transfer_wire", "route_start", "link_start", "links",
    "occupancy", "latency", "channel_start", "collective_mode", "collective_fraction", "collective_run",
    "run_offset_start", "run_offsets", "collective_stage", "stage_link_start", "stage_links",
    "row_collective_start", "row_collectives", "gate_first", "gate_last"};
static const char *const OUTPUT_NAMES[OUT_COUNT] = {
    "ready", "start", "end", "posted", "departed", "arrival", "group_posted", "group_start", "group_done",
    "rank_clock", "rank_done", "stuck_item", "collective_ready", "collective_start", "collective_end"};

static PyObject *names_tuple(const char *const *names, Py_ssize_t count) {
    PyObject *tuple = PyTuple_New(count);
    if (!tuple) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (!name) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, i, name);
    }
    return tuple;
}

static PyMethodDef methods[] = {
    {"run", engine_run, METH_VARARGS,
     "run(semantics, comm_overhead, inputs, link_count, outputs): time one step (see schedules/engine.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_engine", "The timing engine's compiled walk.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__engine(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *inputs = names_tuple(INPUT_NAMES, IN_COUNT);
    if (!inputs || PyModule_AddObject(m, "INPUTS", inputs) < 0) {
        Py_XDECREF(inputs);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *outputs = names_tuple(OUTPUT_NAMES, OUT_COUNT);
    if (!outputs || PyModule_AddObject(m, "OUTPUTS", outputs) < 0) {
        Py_XDECREF(outputs);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
