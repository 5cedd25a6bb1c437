/*
 * pipesim._rendezvous: the direct rendezvous engine (pipesim/sim/direct.py) in C.
 *
 * Same algorithm, same inputs (the compiled programs of ``direct.compiled_programs``),
 * same floating-point operations in the same order, same Trace events in the same
 * order: tests/test_engine_fast.py holds it to the Python version and to the SimPy
 * process engine on random schedules, costs, clusters and placements. What it saves is
 * the interpreter's work per action (a large step has ~400k of them), which is most of
 * a step's simulation time in Python.
 *
 * Built by setup.py as an optional extension: without a C compiler pipesim installs
 * and runs the Python version (``pipesim.sim.direct.ACCELERATED`` says which is in use).
 */
#include "pipesim_native.h"
#include <stdlib.h>
#include <string.h>

/* Compiled entry layouts (pipesim/sim/direct.py, compiled_programs). */
enum { E_TYPE = 0, C_ITEM = 1, C_STAGE = 2, C_KIND = 3, C_MICROBATCH = 4, C_TEXT = 5, C_SOURCE = 6,
       C_RECEIVE_KIND = 7, C_RECEIVE_TEXT = 8, C_SLOT = 9, G_ORDINAL = 1, G_SIZE = 2, G_TRANSFERS = 3 };
enum { T_NUMBER = 0, T_IS_SEND = 1, T_STAGE = 2, T_KIND = 3, T_MICROBATCH = 4, T_TEXT = 5, T_WIRE = 6 };

typedef struct {
    PyObject *transfers; /* borrowed from the programs */
    double posted, start, latest, done;
    int rank;
    int outstanding;
    int completed;
} Group;


typedef struct {
    PyObject *programs;
    int ranks;
    double *slot_seconds;
    char *slot_known;
    double *slot_tp;
    Py_ssize_t slot_count;
    int has_tp;
    PyObject *paired;
    int has_paired;
    double comm_overhead;
    /* wires: per wire slot, its links (ids into free_at), seconds and latency */
    int use_wires;
    Py_ssize_t wire_count;
    Py_ssize_t *wire_offset; /* wire_count + 1 offsets into wire_links */
    Py_ssize_t *wire_links;
    double *wire_seconds;
    double *wire_latency;
    char *wire_known;
    double *free_at;
    PyObject *arrival_of;
    PyObject *events;
    PyObject *tp_events;
    PyTypeObject *event_type;
    PyObject *unknown_error;
    PyObject *s_compute, *s_send, *s_recv, *s_wait, *s_tp;
    PyObject *tp_kind;
    PyObject **rank_objects;
    /* state */
    Group *groups;
    Py_ssize_t *group_base;
    Py_ssize_t *posted_count;
    Py_ssize_t *next_start;
    char *stream_busy;
    double *stream_free;
    Py_ssize_t *offer_group;
    PyObject **offer_entry;
    Py_ssize_t *position;
    double *clocks;
    Py_ssize_t *blocked_on;
    char *finished;
    PipesimHeap starts; /* group starts by (moment, rank), the group index as payload */
} State;

/* Append TraceEvent(rank, text, kind, stage, microbatch, start, end, stream) to ``target``. */
static int record_to(State *st, PyObject *target, int rank, PyObject *text, PyObject *kind, PyObject *stage,
                     PyObject *microbatch, double start, double end, PyObject *stream) {
    PyObject *event = st->event_type->tp_alloc(st->event_type, 8);
    if (!event)
        return -1;
    PyObject *start_object = PyFloat_FromDouble(start);
    PyObject *end_object = PyFloat_FromDouble(end);
    if (!start_object || !end_object) {
        Py_XDECREF(start_object);
        Py_XDECREF(end_object);
        Py_DECREF(event);
        return -1;
    }
    PyObject *rank_object = st->rank_objects[rank];
    Py_INCREF(rank_object);
    Py_INCREF(text);
    Py_INCREF(kind);
    Py_INCREF(stage);
    Py_INCREF(microbatch);
    Py_INCREF(stream);
    PyTuple_SET_ITEM(event, 0, rank_object);
    PyTuple_SET_ITEM(event, 1, text);
    PyTuple_SET_ITEM(event, 2, kind);
    PyTuple_SET_ITEM(event, 3, stage);
    PyTuple_SET_ITEM(event, 4, microbatch);
    PyTuple_SET_ITEM(event, 5, start_object);
    PyTuple_SET_ITEM(event, 6, end_object);
    PyTuple_SET_ITEM(event, 7, stream);
    /* Every item is atomic (ints, floats, strings), so no cycle can pass through the
     * event: CPython itself untracks such tuples at its next collection. Untracked now,
     * the ~400k events of a large step cost the collector nothing. */
    PyObject_GC_UnTrack(event);
    int failed = PyList_Append(target, event);
    Py_DECREF(event);
    return failed;
}

static int record(State *st, int rank, PyObject *text, PyObject *kind, PyObject *stage, PyObject *microbatch,
                  double start, double end, PyObject *stream) {
    return record_to(st, st->events, rank, text, kind, stage, microbatch, start, end, stream);
}

static Py_ssize_t as_index(PyObject *tuple, Py_ssize_t position) {
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, position));
}

static int advance(State *st, int rank);

static int schedule_next(State *st, int rank) {
    Py_ssize_t index = st->next_start[rank];
    if (index == st->posted_count[rank]) {
        st->stream_busy[rank] = 0;
        return 0;
    }
    Py_ssize_t group_index = st->group_base[rank] + index;
    Group *group = &st->groups[group_index];
    st->next_start[rank] = index + 1;
    st->stream_busy[rank] = 1;
    group->start = group->posted > st->stream_free[rank] ? group->posted : st->stream_free[rank];
    return pipesim_heap_push(&st->starts, group->start, rank, group_index);
}

static int complete(State *st, Py_ssize_t group_index) {
    Group *group = &st->groups[group_index];
    double done = group->start > group->latest ? group->start : group->latest;
    group->done = done;
    group->completed = 1;
    int rank = group->rank;
    st->stream_free[rank] = done;
    if (schedule_next(st, rank) < 0)
        return -1;
    if (st->blocked_on[rank] == group_index) {
        st->blocked_on[rank] = -1;
        return advance(st, rank);
    }
    return 0;
}

static int finish(State *st, int rank) {
    double clock = st->clocks[rank];
    Py_ssize_t posted = st->posted_count[rank];
    if (posted) {
        Group *last_group = &st->groups[st->group_base[rank] + posted - 1];
        if (last_group->done > clock) {
            PyObject *entries = PyTuple_GET_ITEM(st->programs, rank);
            PyObject *last = PyTuple_GET_ITEM(entries, PyTuple_GET_SIZE(entries) - 1);
            PyObject *source;
            Py_ssize_t base;
            if (as_index(last, E_TYPE) == 1) {
                PyObject *transfers = PyTuple_GET_ITEM(last, G_TRANSFERS);
                source = PyTuple_GET_ITEM(transfers, PyTuple_GET_SIZE(transfers) - 1);
                base = T_STAGE;
            } else {
                source = last;
                base = C_STAGE;
            }
            /* (stage, kind, microbatch, text) at base .. base + 3 in both layouts */
            if (record(st, rank, PyTuple_GET_ITEM(source, base + 3), PyTuple_GET_ITEM(source, base + 1),
                       PyTuple_GET_ITEM(source, base), PyTuple_GET_ITEM(source, base + 2), clock, last_group->done,
                       st->s_wait) < 0)
                return -1;
            st->clocks[rank] = last_group->done;
        }
    }
    st->finished[rank] = 1;
    return 0;
}

static int advance(State *st, int rank) {
    PyObject *entries = PyTuple_GET_ITEM(st->programs, rank);
    Py_ssize_t count = PyTuple_GET_SIZE(entries);
    Py_ssize_t index = st->position[rank];
    double clock = st->clocks[rank];
    Py_ssize_t base = st->group_base[rank];
    while (index < count) {
        PyObject *entry = PyTuple_GET_ITEM(entries, index);
        if (as_index(entry, E_TYPE) == 0) {
            PyObject *item = PyTuple_GET_ITEM(entry, C_ITEM);
            PyObject *stage = PyTuple_GET_ITEM(entry, C_STAGE);
            PyObject *kind = PyTuple_GET_ITEM(entry, C_KIND);
            PyObject *microbatch = PyTuple_GET_ITEM(entry, C_MICROBATCH);
            Py_ssize_t source = as_index(entry, C_SOURCE);
            Py_ssize_t slot = as_index(entry, C_SLOT);
            if (source >= 0) {
                Group *needed = &st->groups[base + source];
                if (!needed->completed) {
                    st->position[rank] = index;
                    st->clocks[rank] = clock;
                    st->blocked_on[rank] = base + source;
                    return 0;
                }
                double start = clock;
                if (needed->done > clock)
                    clock = needed->done;
                if (record(st, rank, PyTuple_GET_ITEM(entry, C_RECEIVE_TEXT), PyTuple_GET_ITEM(entry, C_RECEIVE_KIND),
                           stage, microbatch, start, clock, st->s_recv) < 0)
                    return -1;
            }
            double end;
            PyObject *pair_seconds = NULL;
            if (st->has_paired) {
                pair_seconds = PyDict_GetItemWithError(st->paired, item);
                if (!pair_seconds && PyErr_Occurred())
                    return -1;
            }
            if (pair_seconds) {
                double seconds = PyFloat_AsDouble(pair_seconds);
                if (seconds == -1.0 && PyErr_Occurred())
                    return -1;
                end = clock + seconds;
            } else {
                if (slot < 0 || slot >= st->slot_count || !st->slot_known[slot]) {
                    PyErr_Format(st->unknown_error, "rank %d: cannot simulate action %S (unknown kind %R)", rank,
                                 item, kind);
                    return -1;
                }
                end = clock + st->slot_seconds[slot];
            }
            if (record(st, rank, PyTuple_GET_ITEM(entry, C_TEXT), kind, stage, microbatch, clock, end,
                       st->s_compute) < 0)
                return -1;
            clock = end;
            if (st->has_tp && slot >= 0 && slot < st->slot_count) {
                double collectives = st->slot_tp[slot];
                if (collectives != 0.0) {
                    /* TraceEvent(rank, f"{tp_kind}({text})", tp_kind, stage, microbatch, ..., "tp") */
                    PyObject *text = PyUnicode_FromFormat("%U(%U)", st->tp_kind, PyTuple_GET_ITEM(entry, C_TEXT));
                    if (!text)
                        return -1;
                    int failed = record_to(st, st->tp_events, rank, text, st->tp_kind, stage, microbatch, clock,
                                           clock + collectives, st->s_tp);
                    Py_DECREF(text);
                    if (failed)
                        return -1;
                    clock += collectives;
                }
            }
            index++;
            continue;
        }
        clock += st->comm_overhead * (double)as_index(entry, G_SIZE);
        Py_ssize_t ordinal = st->posted_count[rank]++;
        Group *group = &st->groups[base + ordinal];
        group->transfers = PyTuple_GET_ITEM(entry, G_TRANSFERS);
        group->posted = clock;
        group->start = 0.0;
        group->latest = 0.0;
        group->outstanding = 0;
        group->completed = 0;
        group->rank = rank;
        if (!st->stream_busy[rank] && schedule_next(st, rank) < 0)
            return -1;
        index++;
    }
    st->position[rank] = index;
    st->clocks[rank] = clock;
    Py_ssize_t posted = st->posted_count[rank];
    if (posted && !st->groups[base + posted - 1].completed) {
        st->blocked_on[rank] = base + posted - 1; /* the step cannot end before the rank's last transfers */
        return 0;
    }
    return finish(st, rank);
}

static int arrival_of(State *st, PyObject *send, int sender, double now, double *arrival) {
    if (!st->use_wires) {
        PyObject *result = PyObject_CallFunction(st->arrival_of, "OOOd", PyTuple_GET_ITEM(send, T_STAGE),
                                                 PyTuple_GET_ITEM(send, T_KIND), st->rank_objects[sender], now);
        if (!result)
            return -1;
        *arrival = PyFloat_AsDouble(result);
        Py_DECREF(result);
        return (*arrival == -1.0 && PyErr_Occurred()) ? -1 : 0;
    }
    Py_ssize_t wire = as_index(send, T_WIRE);
    if (wire < 0 || wire >= st->wire_count || !st->wire_known[wire]) {
        PyErr_Format(PyExc_KeyError, "no route for send %S", PyTuple_GET_ITEM(send, T_TEXT));
        return -1;
    }
    Py_ssize_t first = st->wire_offset[wire], last = st->wire_offset[wire + 1];
    if (first == last) {
        *arrival = now;
        return 0;
    }
    double start = now;
    for (Py_ssize_t i = first; i < last; i++) {
        double busy_until = st->free_at[st->wire_links[i]];
        if (busy_until > start)
            start = busy_until;
    }
    double done = start + st->wire_seconds[wire];
    for (Py_ssize_t i = first; i < last; i++)
        st->free_at[st->wire_links[i]] = done;
    *arrival = done + st->wire_latency[wire];
    return 0;
}

static int begin(State *st, Py_ssize_t group_index) {
    Group *group = &st->groups[group_index];
    double start = group->start;
    PyObject *transfers = group->transfers;
    Py_ssize_t size = PyTuple_GET_SIZE(transfers);
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *entry = PyTuple_GET_ITEM(transfers, i);
        Py_ssize_t transfer = as_index(entry, T_NUMBER);
        if (st->offer_group[transfer] < 0) {
            st->offer_group[transfer] = group_index;
            st->offer_entry[transfer] = entry;
            group->outstanding++;
            continue;
        }
        Py_ssize_t peer_index = st->offer_group[transfer];
        Group *peer = &st->groups[peer_index];
        int sender;
        double sent_at;
        PyObject *send;
        if (PyTuple_GET_ITEM(entry, T_IS_SEND) == Py_True) {
            sender = group->rank;
            sent_at = group->posted;
            send = entry;
        } else {
            sender = peer->rank;
            sent_at = peer->posted;
            send = st->offer_entry[transfer];
        }
        double arrival;
        if (arrival_of(st, send, sender, start, &arrival) < 0)
            return -1;
        if (record(st, sender, PyTuple_GET_ITEM(send, T_TEXT), PyTuple_GET_ITEM(send, T_KIND),
                   PyTuple_GET_ITEM(send, T_STAGE), PyTuple_GET_ITEM(send, T_MICROBATCH), sent_at, arrival,
                   st->s_send) < 0)
            return -1;
        /* st->groups does not move while the step runs: the pointers stay valid */
        if (arrival > group->latest)
            group->latest = arrival;
        if (arrival > peer->latest)
            peer->latest = arrival;
        if (--peer->outstanding == 0 && complete(st, peer_index) < 0)
            return -1;
    }
    if (group->outstanding == 0)
        return complete(st, group_index);
    return 0;
}

static void release(State *st) {
    Py_XDECREF(st->s_compute);
    Py_XDECREF(st->s_send);
    Py_XDECREF(st->s_recv);
    Py_XDECREF(st->s_wait);
    Py_XDECREF(st->s_tp);
    PyMem_Free(st->slot_seconds);
    PyMem_Free(st->slot_known);
    PyMem_Free(st->slot_tp);
    PyMem_Free(st->wire_offset);
    PyMem_Free(st->wire_links);
    PyMem_Free(st->wire_seconds);
    PyMem_Free(st->wire_latency);
    PyMem_Free(st->wire_known);
    PyMem_Free(st->free_at);
    if (st->rank_objects) {
        for (int rank = 0; rank < st->ranks; rank++)
            Py_XDECREF(st->rank_objects[rank]);
        PyMem_Free(st->rank_objects);
    }
    PyMem_Free(st->groups);
    PyMem_Free(st->group_base);
    PyMem_Free(st->posted_count);
    PyMem_Free(st->next_start);
    PyMem_Free(st->stream_busy);
    PyMem_Free(st->stream_free);
    PyMem_Free(st->offer_group);
    PyMem_Free(st->offer_entry);
    PyMem_Free(st->position);
    PyMem_Free(st->clocks);
    PyMem_Free(st->blocked_on);
    PyMem_Free(st->finished);
    PyMem_Free(st->starts.items);
}

#define ALLOCATE(pointer, count)                                                                                      \
    do {                                                                                                              \
        (pointer) = PyMem_Calloc((count) > 0 ? (size_t)(count) : 1, sizeof(*(pointer)));                              \
        if (!(pointer)) {                                                                                             \
            PyErr_NoMemory();                                                                                         \
            goto fail;                                                                                                \
        }                                                                                                             \
    } while (0)

/* Per cost slot: its seconds (None: a kind without a cost) and tp seconds. */
static int read_slots(State *st, PyObject *slot_seconds, PyObject *slot_tp) {
    st->slot_count = PyList_GET_SIZE(slot_seconds);
    if (PyList_GET_SIZE(slot_tp) != st->slot_count) {
        PyErr_SetString(PyExc_ValueError, "slot_seconds and slot_tp differ in length");
        return -1;
    }
    ALLOCATE(st->slot_seconds, st->slot_count);
    ALLOCATE(st->slot_known, st->slot_count);
    ALLOCATE(st->slot_tp, st->slot_count);
    for (Py_ssize_t i = 0; i < st->slot_count; i++) {
        PyObject *seconds = PyList_GET_ITEM(slot_seconds, i);
        if (seconds != Py_None) {
            st->slot_seconds[i] = PyFloat_AsDouble(seconds);
            if (st->slot_seconds[i] == -1.0 && PyErr_Occurred())
                return -1;
            st->slot_known[i] = 1;
        }
        st->slot_tp[i] = PyFloat_AsDouble(PyList_GET_ITEM(slot_tp, i));
        if (st->slot_tp[i] == -1.0 && PyErr_Occurred())
            return -1;
    }
    return 0;
fail:
    return -1;
}

/* Per wire slot: None, or (link ids, seconds, latency); ``link_count`` ids in all. */
static int read_wires(State *st, PyObject *wires, Py_ssize_t link_count) {
    st->wire_count = PyList_GET_SIZE(wires);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < st->wire_count; i++) {
        PyObject *wire = PyList_GET_ITEM(wires, i);
        if (wire == Py_None)
            continue;
        if (!PyTuple_Check(wire) || PyTuple_GET_SIZE(wire) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(wire, 0))) {
            PyErr_SetString(PyExc_TypeError, "a wire is (link ids, seconds, latency)");
            return -1;
        }
        total += PyTuple_GET_SIZE(PyTuple_GET_ITEM(wire, 0));
    }
    ALLOCATE(st->wire_offset, st->wire_count + 1);
    ALLOCATE(st->wire_links, total);
    ALLOCATE(st->wire_seconds, st->wire_count);
    ALLOCATE(st->wire_latency, st->wire_count);
    ALLOCATE(st->wire_known, st->wire_count);
    ALLOCATE(st->free_at, link_count);
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < st->wire_count; i++) {
        st->wire_offset[i] = at;
        PyObject *wire = PyList_GET_ITEM(wires, i);
        if (wire == Py_None)
            continue;
        PyObject *links = PyTuple_GET_ITEM(wire, 0);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(links); j++) {
            Py_ssize_t link = PyLong_AsSsize_t(PyTuple_GET_ITEM(links, j));
            if (link < 0 || link >= link_count) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "link id %zd outside 0..%zd", link, link_count - 1);
                return -1;
            }
            st->wire_links[at++] = link;
        }
        st->wire_seconds[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(wire, 1));
        st->wire_latency[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(wire, 2));
        if (PyErr_Occurred())
            return -1;
        st->wire_known[i] = 1;
    }
    st->wire_offset[st->wire_count] = at;
    return 0;
fail:
    return -1;
}

PyDoc_STRVAR(run_doc,
             "run(programs, transfer_count, slot_seconds, slot_tp, paired, comm_overhead, wires, link_count,\n"
             "    arrival_of, events, tp_events, event_type, unknown_error, tp_kind) -> stuck\n\n"
             "One rendezvous step over compiled programs, as pipesim.sim.direct.run_rendezvous: Trace events\n"
             "appended to ``events``, tp collectives' events to ``tp_events``; returns (rank, index) of every\n"
             "rank that can never finish. ``wires`` (None: call ``arrival_of(stage, kind, sender, now)``\n"
             "for every send) lists per wire slot None or (link ids, seconds, latency).");

static PyObject *run(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *programs, *slot_seconds, *slot_tp, *paired, *wires, *arrival_of_function, *events, *tp_events;
    PyObject *event_type, *unknown_error, *tp_kind;
    Py_ssize_t transfer_count, link_count;
    double comm_overhead;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!dOnOO!O!OOU", &PyTuple_Type, &programs, &transfer_count, &PyList_Type,
                          &slot_seconds, &PyList_Type, &slot_tp, &PyDict_Type, &paired, &comm_overhead, &wires,
                          &link_count, &arrival_of_function, &PyList_Type, &events, &PyList_Type, &tp_events,
                          &event_type, &unknown_error, &tp_kind))
        return NULL;
    if (!PyType_Check(event_type) || !PyType_IsSubtype((PyTypeObject *)event_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "event_type must be a tuple type");
        return NULL;
    }
    if (wires != Py_None && !PyList_Check(wires)) {
        PyErr_SetString(PyExc_TypeError, "wires must be a list or None");
        return NULL;
    }
    State state;
    memset(&state, 0, sizeof state);
    State *st = &state;
    PyObject *stuck = NULL;
    st->programs = programs;
    st->ranks = (int)PyTuple_GET_SIZE(programs);
    st->paired = paired;
    st->has_paired = PyDict_GET_SIZE(paired) > 0;
    st->comm_overhead = comm_overhead;
    st->arrival_of = arrival_of_function;
    st->events = events;
    st->tp_events = tp_events;
    st->event_type = (PyTypeObject *)event_type;
    st->unknown_error = unknown_error;
    st->tp_kind = tp_kind;
    st->s_compute = PyUnicode_InternFromString("compute");
    st->s_send = PyUnicode_InternFromString("send");
    st->s_recv = PyUnicode_InternFromString("recv");
    st->s_wait = PyUnicode_InternFromString("wait");
    st->s_tp = PyUnicode_InternFromString("tp");
    if (!st->s_compute || !st->s_send || !st->s_recv || !st->s_wait || !st->s_tp)
        goto fail;
    if (read_slots(st, slot_seconds, slot_tp) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < st->slot_count; i++)
        if (st->slot_tp[i] != 0.0)
            st->has_tp = 1;
    st->use_wires = wires != Py_None;
    if (st->use_wires && read_wires(st, wires, link_count) < 0)
        goto fail;
    ALLOCATE(st->rank_objects, st->ranks);
    ALLOCATE(st->group_base, st->ranks);
    Py_ssize_t group_total = 0;
    for (int rank = 0; rank < st->ranks; rank++) {
        st->rank_objects[rank] = PyLong_FromLong(rank);
        if (!st->rank_objects[rank])
            goto fail;
        PyObject *entries = PyTuple_GET_ITEM(programs, rank);
        if (!PyTuple_Check(entries)) {
            PyErr_SetString(PyExc_TypeError, "each program must be a tuple of compiled entries");
            goto fail;
        }
        st->group_base[rank] = group_total;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(entries); i++) {
            PyObject *entry = PyTuple_GET_ITEM(entries, i);
            if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 4) {
                PyErr_SetString(PyExc_TypeError, "a compiled entry must be a tuple");
                goto fail;
            }
            if (as_index(entry, E_TYPE) == 1)
                group_total++;
        }
    }
    if (PyErr_Occurred())
        goto fail;
    ALLOCATE(st->groups, group_total);
    ALLOCATE(st->posted_count, st->ranks);
    ALLOCATE(st->next_start, st->ranks);
    ALLOCATE(st->stream_busy, st->ranks);
    ALLOCATE(st->stream_free, st->ranks);
    ALLOCATE(st->offer_group, transfer_count);
    ALLOCATE(st->offer_entry, transfer_count);
    for (Py_ssize_t i = 0; i < transfer_count; i++)
        st->offer_group[i] = -1;
    ALLOCATE(st->position, st->ranks);
    ALLOCATE(st->clocks, st->ranks);
    ALLOCATE(st->blocked_on, st->ranks);
    for (int rank = 0; rank < st->ranks; rank++)
        st->blocked_on[rank] = -1;
    ALLOCATE(st->finished, st->ranks);

    for (int rank = 0; rank < st->ranks; rank++)
        if (advance(st, rank) < 0)
            goto fail;
    while (st->starts.length) {
        PipesimMoment next = pipesim_heap_pop(&st->starts);
        if (begin(st, next.payload) < 0)
            goto fail;
    }
    stuck = PyList_New(0);
    if (!stuck)
        goto fail;
    for (int rank = 0; rank < st->ranks; rank++) {
        if (st->finished[rank])
            continue;
        Py_ssize_t last = PyTuple_GET_SIZE(PyTuple_GET_ITEM(programs, rank)) - 1;
        PyObject *where = Py_BuildValue("(in)", rank, st->position[rank] < last ? st->position[rank] : last);
        if (!where || PyList_Append(stuck, where) < 0) {
            Py_XDECREF(where);
            Py_CLEAR(stuck);
            goto fail;
        }
        Py_DECREF(where);
    }
fail:
    release(st);
    return stuck;
}

/* ---- compile: the programs as the loop walks them (pipesim/sim/direct.py, _compile) ---- */

/* ``kinds``: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, in that order. */
enum { K_F = 0, K_B, K_I, K_W, K_SEND_F, K_RECV_F, K_SEND_B, K_RECV_B, K_COUNT };


/* str(stage) + str(kind) + str(microbatch), as the f-string of the Python version;
 * written directly for int numbers and an ASCII kind (every real action), else by str(). */
static PyObject *action_text(PyObject *stage, PyObject *kind, PyObject *microbatch) {
    if (PyLong_CheckExact(stage) && PyLong_CheckExact(microbatch) && PyUnicode_Check(kind)) {
        Py_ssize_t kind_length;
        const char *kind_text = PyUnicode_AsUTF8AndSize(kind, &kind_length);
        long stage_value = PyLong_AsLong(stage), microbatch_value = PyLong_AsLong(microbatch);
        if (kind_text && !PyErr_Occurred() && PyUnicode_IS_ASCII(kind) && kind_length < 64) {
            char buffer[128];
            int length = snprintf(buffer, sizeof buffer, "%ld%s%ld", stage_value, kind_text, microbatch_value);
            return PyUnicode_FromStringAndSize(buffer, length);
        }
        PyErr_Clear();
    }
    return PyUnicode_FromFormat("%S%S%S", stage, kind, microbatch);
}

/* Untrack a tuple none of whose items the collector tracks (numbers, strings, such
 * tuples): no cycle can pass through it, and CPython untracks such tuples itself at its
 * next collection; done now, the ~500k tuples of a large step's compiled programs cost
 * the collector nothing when it resumes. */
static void untrack_if_atomic(PyObject *tuple) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        PyObject *item = PyTuple_GET_ITEM(tuple, i);
        if (PyObject_IS_GC(item) && PyObject_GC_IsTracked(item))
            return;
    }
    if (PyObject_GC_IsTracked(tuple))
        PyObject_GC_UnTrack(tuple);
}

/* A tuple of ``count`` new references; on any NULL, all of them released and NULL. */
static PyObject *pack_new(PyObject **items, Py_ssize_t count) {
    PyObject *tuple = PyTuple_New(count);
    int failed = !tuple;
    for (Py_ssize_t i = 0; i < count; i++)
        if (!items[i])
            failed = 1;
    if (failed) {
        for (Py_ssize_t i = 0; i < count; i++)
            Py_XDECREF(items[i]);
        Py_XDECREF(tuple);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        PyTuple_SET_ITEM(tuple, i, items[i]);
    untrack_if_atomic(tuple);
    return tuple;
}

static PyObject *new_reference(PyObject *object) {
    Py_INCREF(object);
    return object;
}

typedef struct {
    PyObject *kinds;
    long stages, microbatches;
    Py_ssize_t *number;  /* per (send stage * 2 + kind) * microbatches + microbatch: its transfer number */
    Py_ssize_t numbered; /* transfers numbered so far, in the order first seen (as dict.setdefault) */
    Py_ssize_t *posted_ordinal; /* per (stage * 2 + kind) * microbatches + microbatch of a receive */
    Py_ssize_t *posted_rank;    /* the rank that posted it, -1 once its consumer took it (dict.pop) */
} Compiler;

static Py_ssize_t transfer_slot(const Compiler *c, long stage, int second, long microbatch) {
    return ((Py_ssize_t)stage * 2 + second) * c->microbatches + microbatch;
}

/* The compute entry of ``item`` on ``rank`` (see compiled_programs); NULL with no error: unusual. */
static PyObject *compile_compute(Compiler *c, PyObject *item, int kind, long stage, long microbatch,
                                 Py_ssize_t rank) {
    PyObject *kinds = c->kinds;
    PyObject *receive_kind = kind == K_F ? PyTuple_GET_ITEM(kinds, K_RECV_F)
                             : (kind == K_B || kind == K_I) ? PyTuple_GET_ITEM(kinds, K_RECV_B) : Py_None;
    Py_ssize_t source = -1;
    if (receive_kind != Py_None) {
        Py_ssize_t at = transfer_slot(c, stage, kind != K_F, microbatch);
        if (c->posted_rank[at] == rank) { /* posted.pop(needed, -1) */
            source = c->posted_ordinal[at];
            c->posted_rank[at] = -1;
        }
    }
    PyObject *stage_object = PyTuple_GET_ITEM(item, 0), *kind_object = PyTuple_GET_ITEM(item, 1);
    PyObject *microbatch_object = PyTuple_GET_ITEM(item, 2);
    untrack_if_atomic(item); /* the action: two ints and a string */
    PyObject *fields[10] = {
        PyLong_FromLong(0), new_reference(item), new_reference(stage_object), new_reference(kind_object),
        new_reference(microbatch_object), action_text(stage_object, kind_object, microbatch_object),
        PyLong_FromSsize_t(source), new_reference(receive_kind),
        action_text(stage_object, receive_kind, microbatch_object),
        PyLong_FromLong(kind <= K_W ? stage * 4 + kind : -1),
    };
    return pack_new(fields, 10);
}

/* The group entry of ``program[first:stop]`` (its ``ordinal``-th group on ``rank``). */
static PyObject *compile_group(Compiler *c, PyObject *program, Py_ssize_t first, Py_ssize_t stop, const int *kind_of,
                               const long *stage_of, const long *microbatch_of, Py_ssize_t ordinal, Py_ssize_t rank) {
    PyObject *transfers = PyTuple_New(stop - first);
    if (!transfers)
        return NULL;
    for (Py_ssize_t i = first; i < stop; i++) {
        PyObject *action = PyTuple_GET_ITEM(program, i);
        int kind = kind_of[i];
        long stage = stage_of[i], microbatch = microbatch_of[i];
        int is_send = kind == K_SEND_F || kind == K_SEND_B;
        /* the SEND both ends name (Action.matching) */
        long send_stage = is_send ? stage : (kind == K_RECV_F ? stage - 1 : stage + 1);
        int backward = kind == K_SEND_B || kind == K_RECV_B;
        if (send_stage < 0 || send_stage >= c->stages) {
            Py_DECREF(transfers);
            return NULL; /* unusual: no such sender */
        }
        Py_ssize_t at = transfer_slot(c, send_stage, backward, microbatch);
        if (c->number[at] < 0)
            c->number[at] = c->numbered++;
        if (!is_send) { /* posted[action] = ordinal */
            Py_ssize_t own = transfer_slot(c, stage, backward, microbatch);
            c->posted_ordinal[own] = ordinal;
            c->posted_rank[own] = rank;
        }
        PyObject *flag = is_send ? Py_True : Py_False;
        PyObject *stage_object = PyTuple_GET_ITEM(action, 0), *kind_object = PyTuple_GET_ITEM(action, 1);
        PyObject *microbatch_object = PyTuple_GET_ITEM(action, 2);
        PyObject *fields[7] = {
            PyLong_FromSsize_t(c->number[at]), new_reference(flag), new_reference(stage_object),
            new_reference(kind_object), new_reference(microbatch_object),
            action_text(stage_object, kind_object, microbatch_object), PyLong_FromLong(send_stage * 2 + backward),
        };
        PyObject *transfer = pack_new(fields, 7);
        if (!transfer) {
            Py_DECREF(transfers);
            return NULL;
        }
        PyTuple_SET_ITEM(transfers, i - first, transfer);
    }
    untrack_if_atomic(transfers);
    PyObject *fields[4] = {PyLong_FromLong(1), PyLong_FromSsize_t(ordinal), PyLong_FromSsize_t(stop - first),
                           transfers};
    return pack_new(fields, 4);
}

PyDoc_STRVAR(compile_doc,
             "compile(programs, joins, num_stages, microbatches, kinds) -> (programs, transfer_count) or None\n\n"
             "pipesim.sim.direct._compile: every rank's lowered program grouped as Schedule.program_items\n"
             "groups it (``joins``: per rank, the positions joined to the one before) and compiled;\n"
             "``kinds`` being F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B. None where an action falls\n"
             "outside the schedule's stages, microbatches or kinds (Python then compiles).");

static PyObject *compile_programs(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *programs, *joins, *kinds;
    long stages, microbatches;
    if (!PyArg_ParseTuple(args, "O!O!llO!", &PyTuple_Type, &programs, &PyTuple_Type, &joins, &stages, &microbatches,
                          &PyTuple_Type, &kinds))
        return NULL;
    Py_ssize_t ranks = PyTuple_GET_SIZE(programs);
    if (PyTuple_GET_SIZE(kinds) != K_COUNT || PyTuple_GET_SIZE(joins) != ranks) {
        PyErr_SetString(PyExc_ValueError, "kinds must name the 8 action kinds and joins hold one set per rank");
        return NULL;
    }
    if (stages < 1 || microbatches < 1 || (double)stages * 2 * microbatches > (double)((Py_ssize_t)1 << 28))
        Py_RETURN_NONE;
    Py_ssize_t slots = (Py_ssize_t)stages * 2 * microbatches;
    Compiler c = {kinds, stages, microbatches, PyMem_Malloc(slots * sizeof(Py_ssize_t)), 0,
                  PyMem_Calloc(slots, sizeof(Py_ssize_t)), PyMem_Malloc(slots * sizeof(Py_ssize_t))};
    PyObject *compiled = PyTuple_New(ranks), *result = NULL;
    int *kind_of = NULL;
    long *stage_of = NULL, *microbatch_of = NULL;
    char *joined = NULL;
    if (!c.number || !c.posted_ordinal || !c.posted_rank || !compiled) {
        if (compiled)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < slots; i++)
        c.number[i] = c.posted_rank[i] = -1;
    for (Py_ssize_t rank = 0; rank < ranks; rank++) {
        PyObject *program = PyTuple_GET_ITEM(programs, rank);
        if (!PyTuple_Check(program))
            goto unusual;
        Py_ssize_t count = PyTuple_GET_SIZE(program);
        PyMem_Free(kind_of);
        PyMem_Free(stage_of);
        PyMem_Free(microbatch_of);
        PyMem_Free(joined);
        kind_of = PyMem_Malloc((count + 1) * sizeof(int));
        stage_of = PyMem_Malloc((count + 1) * sizeof(long));
        microbatch_of = PyMem_Malloc((count + 1) * sizeof(long));
        joined = PyMem_Calloc(count + 1, 1);
        if (!kind_of || !stage_of || !microbatch_of || !joined) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *action = PyTuple_GET_ITEM(program, i);
            /* outside the schedule's stages and microbatches: Python compiles it */
            if (!pipesim_read_action(action, kinds, &kind_of[i], &stage_of[i], &microbatch_of[i]) ||
                stage_of[i] < 0 || stage_of[i] >= c.stages || microbatch_of[i] < 0 ||
                microbatch_of[i] >= c.microbatches)
                goto unusual;
        }
        PyObject *iterator = PyObject_GetIter(PyTuple_GET_ITEM(joins, rank));
        if (!iterator)
            goto done;
        PyObject *position;
        while ((position = PyIter_Next(iterator))) {
            Py_ssize_t at = PyLong_AsSsize_t(position);
            Py_DECREF(position);
            if (at >= 0 && at < count)
                joined[at] = 1;
        }
        Py_DECREF(iterator);
        if (PyErr_Occurred())
            goto done;
        /* Schedule.program_items: transfers joined to the one before share its group */
        PyObject *entries = PyList_New(0);
        if (!entries)
            goto done;
        PyTuple_SET_ITEM(compiled, rank, entries);
        Py_ssize_t ordinal = 0, i = 0;
        while (i < count) {
            PyObject *entry;
            if (kind_of[i] <= K_W) {
                entry = compile_compute(&c, PyTuple_GET_ITEM(program, i), kind_of[i], stage_of[i], microbatch_of[i],
                                        rank);
                i++;
            } else {
                Py_ssize_t stop = i + 1;
                while (stop < count && kind_of[stop] > K_W && joined[stop])
                    stop++;
                entry = compile_group(&c, program, i, stop, kind_of, stage_of, microbatch_of, ordinal++, rank);
                i = stop;
            }
            if (!entry)
                goto unusual;
            int failed = PyList_Append(entries, entry);
            Py_DECREF(entry);
            if (failed)
                goto done;
        }
        PyObject *frozen = PyList_AsTuple(entries);
        if (!frozen)
            goto done;
        untrack_if_atomic(frozen);
        PyTuple_SET_ITEM(compiled, rank, frozen);
        Py_DECREF(entries);
    }
    result = Py_BuildValue("(On)", compiled, c.numbered);
    goto done;
unusual:
    if (!PyErr_Occurred()) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    Py_XDECREF(compiled);
    PyMem_Free(c.number);
    PyMem_Free(c.posted_ordinal);
    PyMem_Free(c.posted_rank);
    PyMem_Free(kind_of);
    PyMem_Free(stage_of);
    PyMem_Free(microbatch_of);
    PyMem_Free(joined);
    return result;
}

/* ---- the dp tail's pass over the step (pipesim/sim/parallel.py, step_tail_events) ---- */

PyDoc_STRVAR(tail_scan_doc,
             "tail_scan(events, num_ranks, grad_kinds) -> (rank_end, last_grad, stage_rank) or None\n\n"
             "Each rank's last end, and per stage the (start, end) of its latest-ending compute event\n"
             "of a kind in ``grad_kinds`` and the rank that ran it, as step_tail_events reads them;\n"
             "None where a rank number falls outside 0..num_ranks-1 (Python decides).");

static PyObject *tail_scan(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *events, *grad_kinds;
    Py_ssize_t num_ranks;
    if (!PyArg_ParseTuple(args, "O!nO", &PyList_Type, &events, &num_ranks, &grad_kinds))
        return NULL;
    if (!PyAnySet_Check(grad_kinds)) {
        PyErr_SetString(PyExc_TypeError, "grad_kinds must be a set");
        return NULL;
    }
    double *rank_end = PyMem_Calloc((size_t)num_ranks + 1, sizeof(double));
    PyObject *last_grad = PyDict_New(), *stage_rank = PyDict_New(), *result = NULL;
    PyObject *compute = PyUnicode_InternFromString("compute");
    if (!rank_end || !last_grad || !stage_rank || !compute) {
        if (!rank_end)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) < 8) {
            PyErr_SetString(PyExc_TypeError, "events must be TraceEvents");
            goto done;
        }
        Py_ssize_t rank = PyLong_AsSsize_t(PyTuple_GET_ITEM(event, 0));
        double end = PyFloat_AsDouble(PyTuple_GET_ITEM(event, 6));
        if (PyErr_Occurred())
            goto done;
        if (rank < 0 || rank >= num_ranks) {
            Py_INCREF(Py_None);
            result = Py_None;
            goto done;
        }
        if (end > rank_end[rank])
            rank_end[rank] = end;
        PyObject *stream = PyTuple_GET_ITEM(event, 7);
        if (stream != compute && !(PyUnicode_Check(stream) && PyUnicode_Compare(stream, compute) == 0))
            continue;
        int is_grad = PySet_Contains(grad_kinds, PyTuple_GET_ITEM(event, 2));
        if (is_grad < 0)
            goto done;
        if (!is_grad)
            continue;
        PyObject *stage = PyTuple_GET_ITEM(event, 3);
        PyObject *previous = PyDict_GetItemWithError(last_grad, stage);
        double previous_end = -1.0;
        if (previous) {
            previous_end = PyFloat_AsDouble(PyTuple_GET_ITEM(previous, 1));
        }
        if (PyErr_Occurred())
            goto done;
        if (!(end > previous_end))
            continue;
        PyObject *span = PyTuple_Pack(2, PyTuple_GET_ITEM(event, 5), PyTuple_GET_ITEM(event, 6));
        int failed = !span || PyDict_SetItem(last_grad, stage, span) < 0 ||
                     PyDict_SetItem(stage_rank, stage, PyTuple_GET_ITEM(event, 0)) < 0;
        Py_XDECREF(span);
        if (failed)
            goto done;
    }
    PyObject *ends = PyList_New(num_ranks);
    if (!ends)
        goto done;
    for (Py_ssize_t rank = 0; rank < num_ranks; rank++) {
        PyObject *value = PyFloat_FromDouble(rank_end[rank]);
        if (!value) {
            Py_DECREF(ends);
            goto done;
        }
        PyList_SET_ITEM(ends, rank, value);
    }
    result = Py_BuildValue("(NOO)", ends, last_grad, stage_rank);
done:
    PyMem_Free(rank_end);
    Py_XDECREF(last_grad);
    Py_XDECREF(stage_rank);
    Py_XDECREF(compute);
    return result;
}

/* ---- the dp tail's bucket runs (pipesim/sim/parallel.py, step_tail_events) ---- */

typedef struct {
    double ready;
    long stage;
    Py_ssize_t first, stop, row;
} Run;

static int run_order(const void *a, const void *b) {
    const Run *x = a, *y = b;
    if (x->ready != y->ready)
        return x->ready < y->ready ? -1 : 1;
    if (x->stage != y->stage)
        return x->stage < y->stage ? -1 : 1;
    return (x->first > y->first) - (x->first < y->first);
}

PyDoc_STRVAR(dp_tail_doc,
             "dp_tail(stages, dp_free, kind, event_type) -> list of events\n\n"
             "step_tail_events' gradient reductions: ``stages`` holds per stage (stage, rank, grad start,\n"
             "grad end, runs, bucket seconds, ready) where ``runs`` is _bucket_runs' (fraction, first,\n"
             "stop) tuple, or None for one run of every bucket ready at ``ready``. Runs are placed first\n"
             "come first served per rank (by ready moment, stage, first bucket) from ``dp_free``,\n"
             "which is updated, and each becomes one ``dp`` event named as _add_buckets names it.");

static PyObject *dp_tail(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *stages, *dp_free, *kind, *event_type_object;
    if (!PyArg_ParseTuple(args, "O!O!UO", &PyList_Type, &stages, &PyList_Type, &dp_free, &kind, &event_type_object))
        return NULL;
    if (!PyType_Check(event_type_object) || !PyType_IsSubtype((PyTypeObject *)event_type_object, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "event_type must be a tuple type");
        return NULL;
    }
    PyTypeObject *event_type = (PyTypeObject *)event_type_object;
    Py_ssize_t count = 0, rows = PyList_GET_SIZE(stages), ranks = PyList_GET_SIZE(dp_free);
    for (Py_ssize_t i = 0; i < rows; i++) {
        PyObject *row = PyList_GET_ITEM(stages, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 7 || !PyTuple_Check(PyTuple_GET_ITEM(row, 5))) {
            PyErr_SetString(PyExc_TypeError, "a stage row is (stage, rank, start, end, runs, seconds, ready)");
            return NULL;
        }
        PyObject *runs = PyTuple_GET_ITEM(row, 4);
        count += runs == Py_None ? 1 : PyTuple_Size(runs);
        if (PyErr_Occurred())
            return NULL;
    }
    Run *placed = PyMem_Malloc(((size_t)count + 1) * sizeof(Run));
    PyObject *tail = PyList_New(0), *dp = PyUnicode_InternFromString("dp"), *minus_one = PyLong_FromLong(-1);
    if (!placed || !tail || !dp || !minus_one) {
        if (!placed)
            PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        PyObject *row = PyList_GET_ITEM(stages, i);
        long stage = PyLong_AsLong(PyTuple_GET_ITEM(row, 0));
        double start = PyFloat_AsDouble(PyTuple_GET_ITEM(row, 2)), end = PyFloat_AsDouble(PyTuple_GET_ITEM(row, 3));
        PyObject *runs = PyTuple_GET_ITEM(row, 4);
        Py_ssize_t buckets = PyTuple_GET_SIZE(PyTuple_GET_ITEM(row, 5));
        if (PyErr_Occurred())
            goto fail;
        if (runs == Py_None) {
            Run run = {PyFloat_AsDouble(PyTuple_GET_ITEM(row, 6)), stage, 0, buckets, i};
            placed[at++] = run;
        } else {
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(runs); j++) {
                PyObject *item = PyTuple_GET_ITEM(runs, j);
                double fraction = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 0));
                Py_ssize_t first = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
                Py_ssize_t stop = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 2));
                if (PyErr_Occurred())
                    goto fail;
                if (first < 0 || stop > buckets || first >= stop) {
                    PyErr_SetString(PyExc_ValueError, "a run outside the stage's buckets");
                    goto fail;
                }
                Run run = {start + fraction * (end - start), stage, first, stop, i};
                placed[at++] = run;
            }
        }
        if (PyErr_Occurred())
            goto fail;
    }
    qsort(placed, (size_t)count, sizeof(Run), run_order);
    for (Py_ssize_t i = 0; i < count; i++) {
        Run *run = &placed[i];
        PyObject *row = PyList_GET_ITEM(stages, run->row);
        PyObject *rank_object = PyTuple_GET_ITEM(row, 1), *seconds = PyTuple_GET_ITEM(row, 5);
        Py_ssize_t rank = PyLong_AsSsize_t(rank_object);
        if (rank == -1 && PyErr_Occurred())
            goto fail;
        if (rank < 0 || rank >= ranks) {
            PyErr_Format(PyExc_IndexError, "rank %zd has no dp stream", rank);
            goto fail;
        }
        double free_at = PyFloat_AsDouble(PyList_GET_ITEM(dp_free, rank));
        double start = run->ready > free_at ? run->ready : free_at;
        double total = 0.0;
        for (Py_ssize_t b = run->first; b < run->stop; b++)
            total += PyFloat_AsDouble(PyTuple_GET_ITEM(seconds, b));
        if (PyErr_Occurred())
            goto fail;
        double end = start + total;
        PyObject *name = run->stop - 1 == run->first
                             ? PyUnicode_FromFormat("%ld%U[%zd]", run->stage, kind, run->first)
                             : PyUnicode_FromFormat("%ld%U[%zd-%zd]", run->stage, kind, run->first, run->stop - 1);
        PyObject *event = name ? event_type->tp_alloc(event_type, 8) : NULL;
        PyObject *start_object = PyFloat_FromDouble(start), *end_object = PyFloat_FromDouble(end);
        if (!event || !start_object || !end_object) {
            Py_XDECREF(name);
            Py_XDECREF(event);
            Py_XDECREF(start_object);
            Py_XDECREF(end_object);
            goto fail;
        }
        PyObject *fields[8] = {rank_object, name, kind, PyTuple_GET_ITEM(row, 0), minus_one, start_object, end_object,
                               dp};
        for (int f = 0; f < 8; f++) {
            if (f != 1 && f != 5 && f != 6)
                Py_INCREF(fields[f]);
            PyTuple_SET_ITEM(event, f, fields[f]);
        }
        PyObject *free_object = PyFloat_FromDouble(end);
        int failed = !free_object || PyList_Append(tail, event) < 0;
        Py_DECREF(event);
        if (failed) {
            Py_XDECREF(free_object);
            goto fail;
        }
        PyList_SetItem(dp_free, rank, free_object); /* steals it, releases the old value */
    }
    PyMem_Free(placed);
    Py_DECREF(dp);
    Py_DECREF(minus_one);
    return tail;
fail:
    PyMem_Free(placed);
    Py_XDECREF(tail);
    Py_XDECREF(dp);
    Py_XDECREF(minus_one);
    return NULL;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, run_doc},
    {"compile", compile_programs, METH_VARARGS, compile_doc},
    {"tail_scan", tail_scan, METH_VARARGS, tail_scan_doc},
    {"dp_tail", dp_tail, METH_VARARGS, dp_tail_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipesim._rendezvous",
    "The direct rendezvous engine's inner loop in C (see pipesim/sim/direct.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rendezvous(void) {
    return PyModule_Create(&module);
}
