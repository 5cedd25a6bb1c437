/*
 * schedules._accounting: one rank's time accounting (schedules/accounting.py,
 * ``_rank_time``) in C, for the usual case where what holds the rank never overlaps.
 *
 * The same rule, the same floating-point operations in the same order, so the same
 * seconds to the last bit: tests/test_accounting_native.py holds it to the Python
 * version on simulated and hand-made traces. A large step has ~400k events, and this
 * is the loop that reads every one of them; the general case (overlapping waits, sends
 * that hold the rank) returns None and stays in Python.
 *
 * Built by setup.py as an optional extension; without it the Python version runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Parts, indexed as PARTS in accounting.py. */
enum { P_BUSY = 0, P_TP, P_OPTIMIZER, P_BUBBLE, P_EXPOSED, P_DP, P_OVERHEAD, P_COUNT };
/* TraceEvent fields. */
enum { F_ACTION = 1, F_KIND = 2, F_STAGE = 3, F_MICROBATCH = 4, F_START = 5, F_END = 6, F_STREAM = 7 };
static const double ROUNDING = 1e-12;

typedef struct {
    double start, end;
} Span;

typedef struct {
    Span *items;
    Py_ssize_t length, capacity;
} Spans;

static int push(Spans *spans, double start, double end) {
    if (spans->length == spans->capacity) {
        Py_ssize_t capacity = spans->capacity ? spans->capacity * 2 : 64;
        Span *grown = PyMem_Realloc(spans->items, capacity * sizeof(Span));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        spans->items = grown;
        spans->capacity = capacity;
    }
    spans->items[spans->length].start = start;
    spans->items[spans->length].end = end;
    spans->length++;
    return 0;
}

static int by_start_then_end(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

static void sort(Spans *spans) {
    qsort(spans->items, (size_t)spans->length, sizeof(Span), by_start_then_end);
}

/* _union: sorted spans merged where they touch or overlap (in place). */
static void unite(Spans *spans) {
    Py_ssize_t merged = 0;
    for (Py_ssize_t i = 0; i < spans->length; i++) {
        Span span = spans->items[i];
        if (merged && span.start <= spans->items[merged - 1].end) {
            if (span.end > spans->items[merged - 1].end)
                spans->items[merged - 1].end = span.end;
        } else {
            spans->items[merged++] = span;
        }
    }
    spans->length = merged;
}

/* _measure: length of the union of sorted spans. */
static double measure(const Spans *spans) {
    double total = 0.0, reach = -INFINITY;
    for (Py_ssize_t i = 0; i < spans->length; i++) {
        double start = spans->items[i].start, end = spans->items[i].end;
        if (end > reach) {
            total += end - (reach > start ? reach : start);
            reach = end;
        }
    }
    return total;
}

/* _overlap: length of (union of first) meeting (union of second); both sorted. */
static double overlap(const Spans *first, const Spans *second) {
    double total = 0.0, reach = -INFINITY;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < first->length; i++) {
        double start = first->items[i].start, end = first->items[i].end;
        if (reach > start)
            start = reach;
        if (end <= start)
            continue;
        reach = end;
        while (j < second->length && second->items[j].end <= start)
            j++;
        for (Py_ssize_t k = j; k < second->length && second->items[k].start < end; k++) {
            double high = second->items[k].end < end ? second->items[k].end : end;
            double low = second->items[k].start > start ? second->items[k].start : start;
            double piece = high - low;
            total += piece > 0.0 ? piece : 0.0;
        }
    }
    return total;
}

static int disjoint(const Spans *spans) {
    for (Py_ssize_t i = 1; i < spans->length; i++)
        if (!(spans->items[i].start >= spans->items[i - 1].end))
            return 0;
    return 1;
}

/* The stream of an event: 0 recv, 1 compute, 2 tp, 3 step, 4 wait, 5 send, 6 dp, -1 other. */
static PyObject *stream_names[7];
static const char *const stream_text[7] = {"recv", "compute", "tp", "step", "wait", "send", "dp"};

static int stream_of(PyObject *stream) {
    for (int i = 0; i < 7; i++)
        if (stream == stream_names[i])
            return i;
    if (!PyUnicode_Check(stream))
        return -1;
    for (int i = 0; i < 7; i++)
        if (PyUnicode_CompareWithASCIIString(stream, stream_text[i]) == 0)
            return i;
    return -1;
}

/* Action text -> moment: ``{event.action: event.start}`` of one stream's events, as
 * accounting.py's dicts (a later event of the same text replaces an earlier one),
 * keyed by the text's bytes. The strings stay alive in the events while it is used. */
#define INLINE_TEXT 30
typedef struct {
    uint64_t hash;
    double moment;
    const char *text; /* the event's own text where it does not fit inline */
    unsigned char used, length;
    char inline_text[INLINE_TEXT]; /* the text itself: one cache line holds the whole entry */
} Entry;

/* Dense mode: every text of the table that reads canonically as
 * f"{stage}{kind}{microbatch}" with one of its two kinds, at (stage, kind, microbatch).
 * The lookups are such texts, so a text that does not read that way can never be found
 * and is left out: the same answers as the dict of texts, without hashing a string per
 * lookup (a large step has ~130k). */
typedef struct {
    Entry *entries;
    size_t mask;
    int dense;
    const char *kinds[2];
    long stage_low, stages, microbatch_low, microbatches;
    double *moments;
    char *known;
} Table;

/* A canonical decimal int (as str(int) writes it) at ``*at``, up to ``end`` or a non-digit. */
static int parse_int(const char **at, const char *end, long *value) {
    const char *p = *at;
    int negative = p < end && *p == '-';
    if (negative)
        p++;
    if (p >= end || *p < '0' || *p > '9')
        return 0;
    if (*p == '0' && (negative || (p + 1 < end && p[1] >= '0' && p[1] <= '9')))
        return 0; /* "-0" and leading zeros are not how str() writes a number */
    long number = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        if (number > 100000000000000L)
            return 0;
        number = number * 10 + (*p++ - '0');
    }
    *value = negative ? -number : number;
    *at = p;
    return 1;
}

/* Which of the table's kinds ``text`` reads as (0 or 1) with its numbers, or -1. */
static int parse_action_text(const Table *table, const char *text, Py_ssize_t length, long *stage, long *microbatch) {
    const char *at = text, *end = text + length;
    if (!parse_int(&at, end, stage))
        return -1;
    for (int k = 0; k < 2; k++) {
        size_t kind_length = strlen(table->kinds[k]);
        if ((size_t)(end - at) > kind_length && !memcmp(at, table->kinds[k], kind_length)) {
            const char *rest = at + kind_length;
            if (parse_int(&rest, end, microbatch) && rest == end)
                return k;
        }
    }
    return -1;
}

static uint64_t hash_text(const char *text, Py_ssize_t length) {
    uint64_t hash = 1469598103934665603ULL; /* FNV-1a */
    for (Py_ssize_t i = 0; i < length; i++) {
        hash ^= (unsigned char)text[i];
        hash *= 1099511628211ULL;
    }
    hash ^= hash >> 33; /* spread FNV's weak low bits, which pick the slot */
    hash *= 0xff51afd7ed558ccdULL;
    hash ^= hash >> 33;
    return hash;
}

static const char *text_of(const Entry *entry) {
    return entry->length <= INLINE_TEXT ? entry->inline_text : entry->text;
}

static Entry *slot_of(const Table *table, const char *text, Py_ssize_t length, uint64_t hash) {
    size_t at = (size_t)hash & table->mask;
    for (;;) {
        Entry *entry = &table->entries[at];
        if (!entry->used || (entry->hash == hash && entry->length == length && !memcmp(text_of(entry), text, length)))
            return entry;
        at = (at + 1) & table->mask;
    }
}

/* The dense table (see Table) of every event of ``stream``: 1 if built, 0 if its numbers
 * span too much for a dense array (the hash table then), -1 on error. */
static int build_dense(Table *table, PyObject *events, int stream) {
    Py_ssize_t n = PyList_GET_SIZE(events), count = 0;
    long stage_low = 0, stage_high = -1, microbatch_low = 0, microbatch_high = -1;
    for (int pass = 0; pass < 2; pass++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *event = PyList_GET_ITEM(events, i);
            if (stream_of(PyTuple_GET_ITEM(event, F_STREAM)) != stream)
                continue;
            Py_ssize_t length;
            const char *text = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(event, F_ACTION), &length);
            if (!text)
                return -1;
            long stage, microbatch;
            int kind = parse_action_text(table, text, length, &stage, &microbatch);
            if (kind < 0)
                continue; /* no lookup can ever ask for it */
            if (pass == 0) {
                if (!count || stage < stage_low)
                    stage_low = stage;
                if (!count || stage > stage_high)
                    stage_high = stage;
                if (!count || microbatch < microbatch_low)
                    microbatch_low = microbatch;
                if (!count || microbatch > microbatch_high)
                    microbatch_high = microbatch;
                count++;
                continue;
            }
            double moment = PyFloat_AsDouble(PyTuple_GET_ITEM(event, F_START));
            if (moment == -1.0 && PyErr_Occurred())
                return -1;
            Py_ssize_t at = ((stage - stage_low) * 2 + kind) * table->microbatches + (microbatch - microbatch_low);
            table->moments[at] = moment; /* a later event of the same text replaces it, as in the dict */
            table->known[at] = 1;
        }
        if (pass == 0) {
            double cells = ((double)(stage_high - stage_low) + 1) * 2 * ((double)(microbatch_high - microbatch_low) + 1);
            if (count && cells > 4.0 * (double)count + 4096.0)
                return 0;
            table->dense = 1;
            table->stage_low = stage_low;
            table->stages = count ? stage_high - stage_low + 1 : 0;
            table->microbatch_low = microbatch_low;
            table->microbatches = count ? microbatch_high - microbatch_low + 1 : 0;
            Py_ssize_t size = (Py_ssize_t)table->stages * 2 * table->microbatches;
            table->moments = PyMem_Malloc(((size_t)size + 1) * sizeof(double));
            table->known = PyMem_Calloc((size_t)size + 1, 1);
            if (!table->moments || !table->known) {
                PyErr_NoMemory();
                return -1;
            }
        }
    }
    return 1;
}

static void free_table(Table *table) {
    PyMem_Free(table->entries);
    PyMem_Free(table->moments);
    PyMem_Free(table->known);
}

/* The table of every event of ``stream`` in ``events``, whose texts lookups build with
 * ``kind0`` or ``kind1``. */
static int build_table(Table *table, PyObject *events, int stream, const char *kind0, const char *kind1) {
    table->kinds[0] = kind0;
    table->kinds[1] = kind1;
    int dense = build_dense(table, events, stream);
    if (dense != 0)
        return dense < 0 ? -1 : 0;
    Py_ssize_t count = 0, n = PyList_GET_SIZE(events);
    for (Py_ssize_t i = 0; i < n; i++)
        if (stream_of(PyTuple_GET_ITEM(PyList_GET_ITEM(events, i), F_STREAM)) == stream)
            count++;
    size_t capacity = 16;
    while (capacity < (size_t)count * 2 + 1)
        capacity *= 2;
    table->entries = PyMem_Calloc(capacity, sizeof(Entry));
    if (!table->entries) {
        PyErr_NoMemory();
        return -1;
    }
    table->mask = capacity - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if (stream_of(PyTuple_GET_ITEM(event, F_STREAM)) != stream)
            continue;
        Py_ssize_t length;
        const char *text = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(event, F_ACTION), &length);
        if (!text)
            return -1;
        double moment = PyFloat_AsDouble(PyTuple_GET_ITEM(event, F_START));
        if (moment == -1.0 && PyErr_Occurred())
            return -1;
        if (length > 255) {
            PyErr_Format(PyExc_ValueError, "action text too long: %R", PyTuple_GET_ITEM(event, F_ACTION));
            return -1;
        }
        uint64_t hash = hash_text(text, length);
        Entry *entry = slot_of(table, text, length, hash);
        entry->used = 1;
        entry->length = (unsigned char)length;
        entry->hash = hash;
        entry->moment = moment;
        if (length <= INLINE_TEXT)
            memcpy(entry->inline_text, text, length);
        else
            entry->text = text;
    }
    return 0;
}

static char *write_number(char *at, long value) {
    char digits[24];
    int count = 0;
    unsigned long magnitude = value < 0 ? 0UL - (unsigned long)value : (unsigned long)value;
    do {
        digits[count++] = (char)('0' + magnitude % 10);
        magnitude /= 10;
    } while (magnitude);
    if (value < 0)
        *at++ = '-';
    while (count)
        *at++ = digits[--count];
    return at;
}

/* ``table.get(f"{stage}{kind}{microbatch}")``: 1 and the moment if found, 0 if not, -1 on error. */
static int time_of(const Table *table, long stage, const char *kind, PyObject *microbatch, double *found) {
    long microbatch_value = PyLong_AsLong(microbatch);
    if (microbatch_value == -1 && PyErr_Occurred())
        return -1;
    if (table->dense) {
        int k = strcmp(kind, table->kinds[0]) == 0 ? 0 : strcmp(kind, table->kinds[1]) == 0 ? 1 : -1;
        long row = stage - table->stage_low, column = microbatch_value - table->microbatch_low;
        if (k < 0 || row < 0 || row >= table->stages || column < 0 || column >= table->microbatches)
            return 0;
        Py_ssize_t at = ((Py_ssize_t)row * 2 + k) * table->microbatches + column;
        if (!table->known[at])
            return 0;
        *found = table->moments[at];
        return 1;
    }
    char buffer[96];
    char *at = write_number(buffer, stage);
    size_t kind_length = strlen(kind);
    memcpy(at, kind, kind_length);
    at = write_number(at + kind_length, microbatch_value);
    Py_ssize_t length = at - buffer;
    Entry *entry = slot_of(table, buffer, length, hash_text(buffer, length));
    if (!entry->used)
        return 0;
    *found = entry->moment;
    return 1;
}

static int kind_is(PyObject *kind, const char *text) {
    return PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, text) == 0;
}

/* accounting._rank_time's seconds (indexed like PARTS) for one rank's events, a new
 * list; None where what holds the rank overlaps (the general sweep, left to Python). */
static PyObject *rank_seconds(PyObject **events, Py_ssize_t count, const Table *sent, const Table *posted,
                              double first, double last) {
    double seconds[P_COUNT] = {0.0};
    Spans spans = {0}, waits = {0}, peer = {0}, reducing = {0};
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *event = events[i];
        if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) < 8) {
            PyErr_SetString(PyExc_TypeError, "events must be TraceEvents");
            goto done;
        }
        int stream = stream_of(PyTuple_GET_ITEM(event, F_STREAM));
        if (stream < 0)
            continue;
        double start = PyFloat_AsDouble(PyTuple_GET_ITEM(event, F_START));
        double end = PyFloat_AsDouble(PyTuple_GET_ITEM(event, F_END));
        if (PyErr_Occurred())
            goto done;
        if (stream == 0) { /* recv */
            if (end > start) {
                if (push(&waits, start, end) < 0)
                    goto done;
                long stage = PyLong_AsLong(PyTuple_GET_ITEM(event, F_STAGE));
                if (stage == -1 && PyErr_Occurred())
                    goto done;
                double ready;
                int found = kind_is(PyTuple_GET_ITEM(event, F_KIND), "RECV_F")
                                ? time_of(sent, stage - 1, "SEND_F", PyTuple_GET_ITEM(event, F_MICROBATCH), &ready)
                                : time_of(sent, stage + 1, "SEND_B", PyTuple_GET_ITEM(event, F_MICROBATCH), &ready);
                if (found < 0)
                    goto done;
                if (found && ready > start && push(&peer, start, ready < end ? ready : end) < 0)
                    goto done;
            }
        } else if (stream >= 1 && stream <= 3) { /* compute, tp, step: they hold the rank */
            if (end > start) {
                seconds[stream - 1] += end - start;
                if (push(&spans, start, end) < 0)
                    goto done;
            }
        } else if (stream == 4) { /* wait */
            if (end > start && push(&waits, start, end) < 0)
                goto done;
        } else if (stream == 5) { /* send */
            if (posted) {
                PyObject *kind = PyTuple_GET_ITEM(event, F_KIND);
                long stage = PyLong_AsLong(PyTuple_GET_ITEM(event, F_STAGE));
                if (stage == -1 && PyErr_Occurred())
                    goto done;
                double accepted;
                int found;
                if (kind_is(kind, "SEND_F"))
                    found = time_of(posted, stage + 1, "RECV_F", PyTuple_GET_ITEM(event, F_MICROBATCH), &accepted);
                else if (kind_is(kind, "SEND_B"))
                    found = time_of(posted, stage - 1, "RECV_B", PyTuple_GET_ITEM(event, F_MICROBATCH), &accepted);
                else {
                    PyErr_SetObject(PyExc_KeyError, kind);
                    goto done;
                }
                if (found < 0)
                    goto done;
                if (found && accepted > start && push(&peer, start, accepted < end ? accepted : end) < 0)
                    goto done;
            }
        } else if (stream == 6) { /* dp */
            if (end > start && push(&reducing, start, end) < 0)
                goto done;
        }
    }
    if (!spans.length && !waits.length && !reducing.length) {
        seconds[P_BUBBLE] = last - first;
    } else {
        sort(&waits);
        unite(&waits);
        for (Py_ssize_t i = 0; i < waits.length; i++)
            if (push(&spans, waits.items[i].start, waits.items[i].end) < 0)
                goto done;
        sort(&spans);
        sort(&reducing);
        if (!disjoint(&spans)) {
            Py_INCREF(Py_None);
            result = Py_None;
            goto done;
        }
        sort(&peer);
        unite(&peer);
        seconds[P_BUBBLE] = overlap(&peer, &waits);
        seconds[P_EXPOSED] = measure(&waits) - seconds[P_BUBBLE];
        if (seconds[P_EXPOSED] < ROUNDING * (last - first)) {
            seconds[P_BUBBLE] += seconds[P_EXPOSED];
            seconds[P_EXPOSED] = 0.0;
        }
        seconds[P_DP] = measure(&reducing) - overlap(&reducing, &spans);
        double spans_first = spans.length ? spans.items[0].start : last;
        double reducing_first = reducing.length ? reducing.items[0].start : last;
        double own_first = reducing_first < spans_first ? reducing_first : spans_first;
        double reducing_last = first;
        for (Py_ssize_t i = 0; i < reducing.length; i++)
            if (reducing.items[i].end > reducing_last)
                reducing_last = reducing.items[i].end;
        double spans_last = spans.length ? spans.items[spans.length - 1].end : first;
        double own_last = reducing_last > spans_last ? reducing_last : spans_last;
        double total = 0.0;
        for (int part = 0; part < P_COUNT; part++)
            total += seconds[part];
        double overhead = (own_last - own_first) - total;
        seconds[P_OVERHEAD] = overhead > 0.0 ? overhead : 0.0;
        seconds[P_BUBBLE] += (own_first - first) + (last - own_last);
    }
    result = PyList_New(P_COUNT);
    if (!result)
        goto done;
    for (int part = 0; part < P_COUNT; part++) {
        PyObject *value = PyFloat_FromDouble(seconds[part]);
        if (!value) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, part, value);
    }
done:
    PyMem_Free(spans.items);
    PyMem_Free(waits.items);
    PyMem_Free(peer.items);
    PyMem_Free(reducing.items);
    return result;
}

PyDoc_STRVAR(accounting_doc,
             "accounting(groups, events, sends_hold, first, last) -> list\n\n"
             "Per rank of ``groups`` (Trace.by_rank), accounting._rank_time's seconds indexed like\n"
             "PARTS, or None where the general sweep must decide; ``events`` is the whole trace\n"
             "(its sends and receives say when data was ready and when receives were posted).");

static PyObject *accounting(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *groups, *events;
    int sends_hold;
    double first, last;
    if (!PyArg_ParseTuple(args, "O!O!pdd", &PyList_Type, &groups, &PyList_Type, &events, &sends_hold, &first,
                          &last))
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) < 8) {
            PyErr_SetString(PyExc_TypeError, "events must be TraceEvents");
            return NULL;
        }
    }
    Table sent = {0}, posted = {0};
    PyObject *result = NULL;
    if (build_table(&sent, events, 5, "SEND_F", "SEND_B") < 0 ||
        (sends_hold && build_table(&posted, events, 0, "RECV_F", "RECV_B") < 0))
        goto done;
    result = PyList_New(PyList_GET_SIZE(groups));
    if (!result)
        goto done;
    for (Py_ssize_t rank = 0; rank < PyList_GET_SIZE(groups); rank++) {
        PyObject *rank_events = PyList_GET_ITEM(groups, rank);
        if (!PyList_Check(rank_events)) {
            PyErr_SetString(PyExc_TypeError, "groups must be lists of events");
            Py_CLEAR(result);
            goto done;
        }
        PyObject *seconds = rank_seconds(PySequence_Fast_ITEMS(rank_events), PyList_GET_SIZE(rank_events), &sent,
                                         sends_hold ? &posted : NULL, first, last);
        if (!seconds) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, rank, seconds);
    }
done:
    free_table(&sent);
    free_table(&posted);
    return result;
}

/* ---- the whole step's summary (schedules/metrics.py, step_metrics) ---- */

/* (stage, microbatch) pairs of one rank's W passes: a small open-addressing set. */
typedef struct {
    long *keys; /* pairs, stage then microbatch */
    char *used;
    size_t mask;
} PairSet;

static size_t pair_slot(const PairSet *set, long stage, long microbatch) {
    uint64_t hash = (uint64_t)stage * 0x9E3779B97F4A7C15ULL ^ ((uint64_t)microbatch + 0x632BE59BD9B4E019ULL);
    hash ^= hash >> 29;
    size_t at = (size_t)hash & set->mask;
    while (set->used[at] && !(set->keys[2 * at] == stage && set->keys[2 * at + 1] == microbatch))
        at = (at + 1) & set->mask;
    return at;
}

/* stash_changes of one rank's events: (moment, +size / -size) sorted, a forward taking its
 * stage's size at its start, the last backward piece of its stage and microbatch (B, or W
 * when the backward is split) releasing it at its end. ``sizes``: per stage (NULL: 1 each).
 * Returns how many changes were written to ``changes`` (room for ``count``), -1 on error. */
typedef struct {
    double moment;
    double change;
} SizedChange;

static int by_moment_then_size(const void *a, const void *b) {
    const SizedChange *x = a, *y = b;
    if (x->moment != y->moment)
        return x->moment < y->moment ? -1 : 1;
    return (x->change > y->change) - (x->change < y->change);
}

static Py_ssize_t stash_changes(PyObject **events, Py_ssize_t count, PyObject *kinds, const double *sizes,
                                Py_ssize_t size_count, SizedChange *changes) {
    PyObject *forward = PyTuple_GET_ITEM(kinds, 0), *backward = PyTuple_GET_ITEM(kinds, 1);
    PyObject *input = PyTuple_GET_ITEM(kinds, 2), *weight = PyTuple_GET_ITEM(kinds, 3);
    size_t capacity = 16;
    while (capacity < (size_t)count * 2 + 1)
        capacity *= 2;
    PairSet weights = {PyMem_Calloc(capacity * 2, sizeof(long)), PyMem_Calloc(capacity, 1), capacity - 1};
    Py_ssize_t changed = -1;
    if (!weights.keys || !weights.used) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) { /* has_weight_pass */
        PyObject *event = events[i];
        if (stream_of(PyTuple_GET_ITEM(event, F_STREAM)) != 1 ||
            PyObject_RichCompareBool(PyTuple_GET_ITEM(event, F_KIND), weight, Py_EQ) != 1)
            continue;
        long stage = PyLong_AsLong(PyTuple_GET_ITEM(event, F_STAGE));
        long microbatch = PyLong_AsLong(PyTuple_GET_ITEM(event, F_MICROBATCH));
        if (PyErr_Occurred())
            goto done;
        size_t at = pair_slot(&weights, stage, microbatch);
        weights.used[at] = 1;
        weights.keys[2 * at] = stage;
        weights.keys[2 * at + 1] = microbatch;
    }
    Py_ssize_t written = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *event = events[i];
        if (stream_of(PyTuple_GET_ITEM(event, F_STREAM)) != 1)
            continue;
        PyObject *kind = PyTuple_GET_ITEM(event, F_KIND);
        int is_forward = PyObject_RichCompareBool(kind, forward, Py_EQ);
        int is_weight = is_forward ? 0 : PyObject_RichCompareBool(kind, weight, Py_EQ);
        int is_backward = (is_forward || is_weight) ? 0
                          : (PyObject_RichCompareBool(kind, backward, Py_EQ) == 1 ||
                             PyObject_RichCompareBool(kind, input, Py_EQ) == 1);
        if (PyErr_Occurred())
            goto done;
        if (!is_forward && !is_weight && !is_backward)
            continue;
        long stage = PyLong_AsLong(PyTuple_GET_ITEM(event, F_STAGE));
        if (stage == -1 && PyErr_Occurred())
            goto done;
        if (is_backward) {
            long microbatch = PyLong_AsLong(PyTuple_GET_ITEM(event, F_MICROBATCH));
            if (microbatch == -1 && PyErr_Occurred())
                goto done;
            if (weights.used[pair_slot(&weights, stage, microbatch)])
                continue; /* its stash is released by the W */
        }
        double size = 1.0;
        if (sizes) {
            if (stage < 0 || stage >= size_count) {
                PyErr_Format(PyExc_IndexError, "stage %ld has no stash size", stage);
                goto done;
            }
            size = sizes[stage];
        }
        changes[written].moment = PyFloat_AsDouble(PyTuple_GET_ITEM(event, is_forward ? F_START : F_END));
        changes[written++].change = is_forward ? size : -size;
        if (PyErr_Occurred())
            goto done;
    }
    qsort(changes, (size_t)written, sizeof(SizedChange), by_moment_then_size);
    changed = written;
done:
    PyMem_Free(weights.keys);
    PyMem_Free(weights.used);
    return changed;
}

/* peak_inflight_of_events's peak stash count (before dividing by the chunks); -1 on error. */
static long peak_stashes(PyObject **events, Py_ssize_t count, PyObject *kinds) {
    SizedChange *changes = PyMem_Malloc(((size_t)count + 1) * sizeof(SizedChange));
    if (!changes) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t changed = stash_changes(events, count, kinds, NULL, 0, changes);
    long held = 0, peak = changed < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i < changed; i++) {
        held += (long)changes[i].change;
        if (held > peak)
            peak = held;
    }
    PyMem_Free(changes);
    return peak;
}

/* Each rank's events, in trace order: ``events[offsets[r] .. offsets[r] + counts[r]]``. */
typedef struct {
    Py_ssize_t *counts, *offsets;
    PyObject **events;
} Groups;

static void free_groups(Groups *groups) {
    PyMem_Free(groups->counts);
    PyMem_Free(groups->offsets);
    PyMem_Free(groups->events);
}

/* Trace.by_rank of ``events`` into ``groups`` (freed by free_groups whatever the result):
 * 0, or 1 where a rank number is outside 0..num_ranks-1 (Python decides), -1 on error. */
static int group_by_rank(PyObject *events, Py_ssize_t num_ranks, Groups *groups) {
    Py_ssize_t n = PyList_GET_SIZE(events);
    groups->counts = PyMem_Calloc((size_t)num_ranks + 1, sizeof(Py_ssize_t));
    groups->offsets = PyMem_Calloc((size_t)num_ranks + 1, sizeof(Py_ssize_t));
    groups->events = PyMem_Malloc(((size_t)n + 1) * sizeof(PyObject *));
    if (!groups->counts || !groups->offsets || !groups->events) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t *counts = groups->counts, *offsets = groups->offsets;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) < 8) {
            PyErr_SetString(PyExc_TypeError, "events must be TraceEvents");
            return -1;
        }
        Py_ssize_t rank = PyLong_AsSsize_t(PyTuple_GET_ITEM(event, 0));
        if (rank == -1 && PyErr_Occurred())
            return -1;
        if (rank < 0 || rank >= num_ranks)
            return 1;
        counts[rank]++;
    }
    for (Py_ssize_t rank = 1; rank < num_ranks; rank++)
        offsets[rank] = offsets[rank - 1] + counts[rank - 1];
    for (Py_ssize_t rank = 0; rank < num_ranks; rank++)
        counts[rank] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        Py_ssize_t rank = PyLong_AsSsize_t(PyTuple_GET_ITEM(event, 0));
        groups->events[offsets[rank] + counts[rank]++] = event;
    }
    return 0;
}

PyDoc_STRVAR(stash_timelines_doc,
             "stash_timelines(events, num_ranks, stash_bytes, bases, kinds) -> list or None\n\n"
             "memory_report's loop: per rank (peak stash bytes, timeline) where the timeline starts at\n"
             "(0.0, base) and steps at every stash change (changes at one moment merged), with\n"
             "``stash_bytes`` per stage and ``bases`` per rank. None where a rank number is outside\n"
             "0..num_ranks-1 (Python decides).");

static PyObject *stash_timelines(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *events, *stash_bytes, *bases, *kinds;
    Py_ssize_t num_ranks;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!", &PyList_Type, &events, &num_ranks, &PyList_Type, &stash_bytes,
                          &PyList_Type, &bases, &PyTuple_Type, &kinds))
        return NULL;
    if (num_ranks < 0 || PyList_GET_SIZE(bases) != num_ranks || PyTuple_GET_SIZE(kinds) < 4) {
        PyErr_SetString(PyExc_ValueError, "one base per rank and the kinds F, B, I, W are needed");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(events), stages = PyList_GET_SIZE(stash_bytes);
    Groups groups = {0};
    double *sizes = PyMem_Malloc(((size_t)stages + 1) * sizeof(double));
    SizedChange *changes = PyMem_Malloc(((size_t)n + 1) * sizeof(SizedChange));
    PyObject *result = NULL;
    if (!sizes || !changes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t stage = 0; stage < stages; stage++) {
        sizes[stage] = PyFloat_AsDouble(PyList_GET_ITEM(stash_bytes, stage));
        if (sizes[stage] == -1.0 && PyErr_Occurred())
            goto done;
    }
    int grouping = group_by_rank(events, num_ranks, &groups);
    if (grouping != 0) {
        if (grouping > 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyList_New(num_ranks);
    if (!result)
        goto done;
    for (Py_ssize_t rank = 0; rank < num_ranks; rank++) {
        double base = PyFloat_AsDouble(PyList_GET_ITEM(bases, rank));
        if (base == -1.0 && PyErr_Occurred())
            goto fail;
        Py_ssize_t changed = stash_changes(groups.events + groups.offsets[rank], groups.counts[rank], kinds, sizes,
                                           stages, changes);
        if (changed < 0)
            goto fail;
        PyObject *timeline = PyList_New(0);
        if (!timeline)
            goto fail;
        double last_time = 0.0, last_value = base, held = 0.0, peak_stash = 0.0;
        /* the point not yet appended: (0.0, base) to begin with */
        for (Py_ssize_t i = 0; i < changed; i++) {
            double time = changes[i].moment;
            held += changes[i].change;
            if (held > peak_stash)
                peak_stash = held;
            if (last_time == time) {
                last_value = base + held;
                continue;
            }
            PyObject *point = Py_BuildValue("(dd)", last_time, last_value);
            if (!point || PyList_Append(timeline, point) < 0) {
                Py_XDECREF(point);
                Py_DECREF(timeline);
                goto fail;
            }
            Py_DECREF(point);
            last_time = time;
            last_value = base + held;
        }
        PyObject *point = Py_BuildValue("(dd)", last_time, last_value);
        PyObject *row = NULL;
        if (point && PyList_Append(timeline, point) == 0) {
            PyObject *frozen = PyList_AsTuple(timeline);
            row = frozen ? Py_BuildValue("(dN)", peak_stash, frozen) : NULL;
        }
        Py_XDECREF(point);
        Py_DECREF(timeline);
        if (!row)
            goto fail;
        PyList_SET_ITEM(result, rank, row);
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    free_groups(&groups);
    PyMem_Free(sizes);
    PyMem_Free(changes);
    return result;
}

PyDoc_STRVAR(summary_doc,
             "summary(events, num_ranks, sends_hold, kinds) -> (first, span, ranks) or None\n\n"
             "What step_metrics reads off a Trace in one pass: the first start, the span to the last\n"
             "end, and per rank (accounting seconds indexed like PARTS or None for the sweep, seconds\n"
             "its sends were in flight, peak forward stashes). ``kinds``: F, B, I, W. None where a\n"
             "rank number is outside 0..num_ranks-1 (Python decides).");

static PyObject *summary(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *events, *kinds;
    Py_ssize_t num_ranks;
    int sends_hold;
    if (!PyArg_ParseTuple(args, "O!npO!", &PyList_Type, &events, &num_ranks, &sends_hold, &PyTuple_Type, &kinds))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (!n || num_ranks < 1 || PyTuple_GET_SIZE(kinds) < 4)
        Py_RETURN_NONE;
    double first = INFINITY, last = -INFINITY;
    Groups groups = {0};
    Table sent = {0}, posted = {0};
    PyObject *result = NULL, *ranks = NULL;
    int grouping = group_by_rank(events, num_ranks, &groups);
    if (grouping != 0) {
        if (grouping > 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        double start = PyFloat_AsDouble(PyTuple_GET_ITEM(event, F_START));
        double end = PyFloat_AsDouble(PyTuple_GET_ITEM(event, F_END));
        if (PyErr_Occurred())
            goto done;
        if (start < first) /* min() and max() keep the first of equals: the same number */
            first = start;
        if (end > last)
            last = end;
    }
    double span = last - first;
    double bound = first + span; /* step_metrics passes (first, first + span) to the accounting */
    if (build_table(&sent, events, 5, "SEND_F", "SEND_B") < 0 ||
        (sends_hold && build_table(&posted, events, 0, "RECV_F", "RECV_B") < 0))
        goto done;
    ranks = PyList_New(num_ranks);
    if (!ranks)
        goto done;
    for (Py_ssize_t rank = 0; rank < num_ranks; rank++) {
        PyObject **rank_events = groups.events + groups.offsets[rank];
        Py_ssize_t count = groups.counts[rank];
        PyObject *seconds = rank_seconds(rank_events, count, &sent, sends_hold ? &posted : NULL, first, bound);
        if (!seconds)
            goto done;
        double comm = 0.0;
        for (Py_ssize_t i = 0; i < count; i++)
            if (stream_of(PyTuple_GET_ITEM(rank_events[i], F_STREAM)) == 5)
                comm += PyFloat_AsDouble(PyTuple_GET_ITEM(rank_events[i], F_END)) -
                        PyFloat_AsDouble(PyTuple_GET_ITEM(rank_events[i], F_START));
        long peak = peak_stashes(rank_events, count, kinds);
        PyObject *row = peak < 0 ? NULL : Py_BuildValue("(Ndl)", seconds, comm, peak);
        if (!row) {
            if (peak < 0)
                Py_DECREF(seconds);
            goto done;
        }
        PyList_SET_ITEM(ranks, rank, row);
    }
    result = Py_BuildValue("(ddO)", first, span, ranks);
done:
    Py_XDECREF(ranks);
    free_groups(&groups);
    free_table(&sent);
    free_table(&posted);
    return result;
}

static PyMethodDef methods[] = {
    {"accounting", accounting, METH_VARARGS, accounting_doc},
    {"summary", summary, METH_VARARGS, summary_doc},
    {"stash_timelines", stash_timelines, METH_VARARGS, stash_timelines_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "schedules._accounting",
    "One rank's time accounting in C (see schedules/accounting.py).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__accounting(void) {
    for (int i = 0; i < 7; i++) {
        stream_names[i] = PyUnicode_InternFromString(stream_text[i]);
        if (!stream_names[i])
            return NULL;
    }
    return PyModule_Create(&module);
}
