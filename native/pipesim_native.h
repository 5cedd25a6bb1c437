/*
 * What pipesim's C loops share (pipesim/sim/_rendezvous.c, schedules/_lowering.c,
 * schedules/_timing.c): reading an action's numbers and kind, and a min-heap of
 * moments. Static inline: each module compiles its own copy, none exports a symbol.
 */
#ifndef PIPESIM_NATIVE_H
#define PIPESIM_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The position of ``kind`` in ``kinds`` (a tuple of strings): by identity first (the
 * interned kinds of every generated action), else by value; -1 if absent. */
static inline int pipesim_kind_index(PyObject *kinds, PyObject *kind) {
    Py_ssize_t count = PyTuple_GET_SIZE(kinds);
    for (Py_ssize_t i = 0; i < count; i++)
        if (PyTuple_GET_ITEM(kinds, i) == kind)
            return (int)i;
    if (!PyUnicode_Check(kind))
        return -1;
    for (Py_ssize_t i = 0; i < count; i++)
        if (PyUnicode_Compare(PyTuple_GET_ITEM(kinds, i), kind) == 0)
            return (int)i;
    return -1;
}

/* An action ``(stage, kind, microbatch)`` as numbers: 1 where it is a 3-tuple of an int,
 * one of ``kinds`` and an int; 0 otherwise, with no error set (the caller hands such
 * input back to Python, which explains it). */
static inline int pipesim_read_action(PyObject *action, PyObject *kinds, int *kind, long *stage, long *microbatch) {
    if (!PyTuple_Check(action) || PyTuple_GET_SIZE(action) != 3)
        return 0;
    *kind = pipesim_kind_index(kinds, PyTuple_GET_ITEM(action, 1));
    *stage = PyLong_AsLong(PyTuple_GET_ITEM(action, 0));
    *microbatch = PyLong_AsLong(PyTuple_GET_ITEM(action, 2));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return *kind >= 0;
}

/* A moment with a key that orders equal moments (a rank, a stage), and a payload. */
typedef struct {
    double moment;
    long key;
    Py_ssize_t payload;
} PipesimMoment;

/* A min-heap of moments by (moment, key): Python's heapq order for (moment, key, ...)
 * tuples whose first two fields never tie. */
typedef struct {
    PipesimMoment *items;
    Py_ssize_t length, capacity;
} PipesimHeap;

static inline int pipesim_before(const PipesimMoment *a, const PipesimMoment *b) {
    return a->moment < b->moment || (a->moment == b->moment && a->key < b->key);
}

static inline int pipesim_heap_push(PipesimHeap *heap, double moment, long key, Py_ssize_t payload) {
    if (heap->length == heap->capacity) {
        Py_ssize_t capacity = heap->capacity ? heap->capacity * 2 : 64;
        PipesimMoment *grown = PyMem_Realloc(heap->items, capacity * sizeof(PipesimMoment));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        heap->items = grown;
        heap->capacity = capacity;
    }
    Py_ssize_t i = heap->length++;
    PipesimMoment item = {moment, key, payload};
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!pipesim_before(&item, &heap->items[parent]))
            break;
        heap->items[i] = heap->items[parent];
        i = parent;
    }
    heap->items[i] = item;
    return 0;
}

/* The earliest moment, removed (the heap must not be empty). */
static inline PipesimMoment pipesim_heap_pop(PipesimHeap *heap) {
    PipesimMoment top = heap->items[0], last = heap->items[--heap->length];
    Py_ssize_t i = 0, n = heap->length;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n)
            break;
        if (child + 1 < n && pipesim_before(&heap->items[child + 1], &heap->items[child]))
            child++;
        if (!pipesim_before(&heap->items[child], &last))
            break;
        heap->items[i] = heap->items[child];
        i = child;
    }
    if (n > 0)
        heap->items[i] = last;
    return top;
}

#endif
